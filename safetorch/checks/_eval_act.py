"""ST003's act: an eval-mode forward that keeps what ``torch.no_grad()`` keeps, and never silently loses a gradient.

The forward runs under no_grad (no activation is saved, no autograd node is made inside it). Its output's floating
tensors, at any depth of a tuple, list, dict, dataclass or ``ModelOutput``, are then passed through one autograd
node (`SafetorchEvaluation`) whose inputs are the module's parameters: the program gets the same values in the same
structure, each tensor with a ``grad_fn``, as it would without safetorch. The node saves no tensor. A backward that
reaches it after all recomputes the forward with grad from its inputs and hands the parameters the gradients the
program would have had: a forward that drew random numbers (a policy sampling its action) is recomputed from the
generators' states it started with, and the program's random stream is left as it was. Its inputs are held weakly:
if the program dropped them, or changed them or the parameters in place since, the backward raises `SafetorchError`
with what safetorch did and what to write, at the program's ``backward()`` line. While a site is not decided yet
(the watched graph is alive: a rollout buffer, outputs kept for a later loss) its newest forward holds its inputs
strongly, and so do the forwards before it while their inputs total at most `HELD_BYTES` (a policy's
observations, not a validation loader's batches: what the act keeps stays no_grad's plus the watched graph and one
forward's inputs), so that such a backward recomputes them; once decided, its newest forward does (a backward right
after a forward: a gradient diagnostic every few batches).

Why not ``torch.utils.checkpoint``: it keeps each forward's inputs and an autograd node per operation alive as long
as its output (a collected evaluation kept about twice no_grad's heap bytes: ``bench/README.md``), and its first call
imports ``torch._dynamo`` and sympy, whose warnings filter makes a program's own warnings print twice. This module
imports nothing beyond torch and changes no warnings state.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from .._exceptions import SafetorchError

HELD = 1 << 16  # forwards of a site not decided yet that may hold their inputs (HELD_BYTES is what bounds them)
HELD_BYTES = 1 << 20  # what the forwards before the newest may hold of their inputs, at most
_BUDGET = 1_000  # objects looked at in a forward's inputs or output

_call_impl = torch.nn.Module._call_impl
_set_grad = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled
_FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class Opaque(Exception):
    """The output holds tensors in an object this act cannot put them back into."""


class Frame:
    """What a backward needs to recompute one forward: held by its `SafetorchEvaluation` node, so it lives as long as
    the output's graph. Never the output itself (a cycle through the node)."""

    __slots__ = ("module", "args", "kwargs", "held", "nbytes", "versions", "params", "reached", "message", "rng",
                 "__weakref__")

    def __init__(self, module: torch.nn.Module, args: Any, kwargs: Any, params: list[torch.Tensor],
                 reached: Callable[[], None], message: Callable[[str], str]) -> None:
        self.module = weakref.ref(module)
        self.versions: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self.args = _weaken(args, self.versions)
        self.kwargs = _weaken(kwargs, self.versions)
        self.held: tuple[Any, Any] | None = None  # the inputs themselves, while the site is not decided
        self.nbytes = 0  # what holding them keeps
        self.params = (len(params), _ids(params), sum(p._version for p in params))
        self.reached = reached
        self.message = message
        #: The random number generators' states before the forward, when the forward drew from them (a policy that
        #: samples its action): the recomputation draws the same numbers, and leaves the program's stream as it was.
        self.rng: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]] | None = None

    def recompute(self) -> tuple[torch.nn.Module, list[torch.Tensor], list[torch.Tensor]]:
        """(module, the recomputed forward's tensors in the grafted slots, the parameters they go to)."""
        module = self.module()
        if module is None:
            raise SafetorchError(self.message("the model is gone"), code="ST003")
        params = [p for p in module.parameters() if p.requires_grad]
        if (len(params), _ids(params)) != self.params[:2]:
            raise SafetorchError(self.message("which of its parameters require grad changed since"), code="ST003")
        if sum(p._version for p in params) != self.params[2]:
            raise SafetorchError(self.message("its parameters were changed in place since (an optimizer step)"),
                                 code="ST003")
        if self.held is not None:
            args, kwargs = self.held
        else:
            args, kwargs = _strengthen(self.args), _strengthen(self.kwargs)
            if args is _GONE or kwargs is _GONE:
                raise SafetorchError(self.message("its input tensors are no longer alive"), code="ST003")
        for ref, version in self.versions:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                raise SafetorchError(self.message("its inputs were changed in place since"), code="ST003")
        if self.rng is None:
            with torch.enable_grad():
                output = _call_impl(module, *args, **kwargs)
        else:
            cpu, devices = self.rng
            with torch.random.fork_rng(devices=[d for d, _ in devices]), torch.enable_grad():
                torch.set_rng_state(cpu)
                for device, state in devices:
                    torch.cuda.set_rng_state(state, device)
                output = _call_impl(module, *args, **kwargs)
        inputs = {id(t) for t in _tensors((args, kwargs))}
        found: list[torch.Tensor] = []
        _walk(output, inputs, found, None, [_BUDGET])
        return module, found, params


def _ids(params: list[torch.Tensor]) -> int:
    return hash(tuple(map(id, params)))


class SafetorchEvaluation(torch.autograd.Function):
    """Gives a no_grad forward's output tensors a ``grad_fn`` that reaches the module's parameters; saves nothing.
    Named for the program that prints an output: ``grad_fn=<SafetorchEvaluationBackward>`` says who ran it."""

    @staticmethod
    def forward(ctx: Any, frame: Frame, count: int, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.frame, ctx.count = frame, count
        return tuple(t.detach() for t in tensors[:count])  # the same storage: not a copy

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        frame: Frame = ctx.frame
        count = ctx.count
        frame.reached()
        create = _is_grad_enabled()
        module, outputs, params = frame.recompute()
        if len(outputs) != count:
            raise SafetorchError(frame.message("recomputing it gave another output"), code="ST003")
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        if pairs:
            got = torch.autograd.grad([o for o, _ in pairs], params, [g for _, g in pairs], allow_unused=True,
                                      create_graph=create)
        else:
            got = (None,) * len(params)
        return (None, None, *([None] * count), *got)


def requires_grad(args: Any, kwargs: Any) -> bool:
    """Whether any tensor in the forward's inputs requires grad (an adversarial example, a generator's output)."""
    return any(t.requires_grad for t in _tensors((args, kwargs)))


def run(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], reached: Callable[[], None],
        message: Callable[[str], str], held: Held) -> Any:
    """The forward under no_grad, its output grafted (see the module's docstring). ``held``: the site's newest frames,
    which hold their inputs (a bounded deque). Raises `Opaque`, after the forward ran, when the
    output cannot be grafted."""
    __tracebackhide__ = True  # noqa: F841
    rng = _rng_states(module)
    previous = _is_grad_enabled()
    _set_grad(False)
    try:
        output = _call_impl(module, *args, **kwargs)
    finally:
        _set_grad(previous)
    params = [p for p in module.parameters() if p.requires_grad]
    tensors = _tensors((args, kwargs))
    inputs = {id(t) for t in tensors}
    found: list[torch.Tensor] = []
    _walk(output, inputs, found, None, [_BUDGET])
    if not found or not params:
        return output
    frame = Frame(module, args, kwargs, params, reached, message)
    frame.rng = _drawn(rng)
    frame.held = (args, kwargs)
    frame.nbytes = sum(t.nbytes for t in tensors)
    if held:
        newest = held[-1]
        if newest.held is not None:
            held.older += newest.nbytes  # an older forward now
    if len(held) == held.maxlen:
        _let_go(held)
    held.append(frame)
    _within(held)
    grafted = SafetorchEvaluation.apply(frame, len(found), *found, *params)
    replace = {id(t): g for t, g in zip(found, grafted, strict=True)}
    return _walk(output, inputs, None, replace, [_BUDGET])


def _rng_states(module: torch.nn.Module) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """The CPU generator's state, and the CUDA generators' of the devices the module's parameters are on (read on the
    host: no synchronisation), as ``torch.utils.checkpoint`` keeps them."""
    devices: list[tuple[int, torch.Tensor]] = []
    if torch.cuda.is_initialized():  # a bool: no device query on a forward
        indices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
        devices = [(i, torch.cuda.get_rng_state(i)) for i in indices]
    return torch.get_rng_state(), devices


def _drawn(before: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]
           ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]] | None:
    """``before`` when the forward drew random numbers (a generator's state moved), else None: a deterministic
    forward keeps nothing (a 5 kB state for each of an evaluation's outputs would be memory no_grad does not keep)."""
    cpu, devices = before
    if not _same_state(cpu, torch.get_rng_state()):
        return before
    if any(not _same_state(state, torch.cuda.get_rng_state(i)) for i, state in devices):
        return before
    return None


#: Compares two generator states: host ByteTensors (``torch.cuda.get_rng_state`` too returns one), never device
#: memory, so no synchronisation (`bench.nosync` knows this name).
_same_state = torch.equal


class Held(collections.deque):  # type: ignore[type-arg]
    """A site's newest forwards that hold their inputs, oldest first; ``older``: the bytes the ones before the newest
    hold. A forward that lets go of its inputs leaves it, so that keeping it within bounds is O(1) a forward."""

    def __init__(self, maxlen: int) -> None:
        super().__init__((), maxlen)
        self.older = 0


def _let_go(held: Held) -> None:
    frame = held.popleft()
    if frame.held is not None:
        frame.held = None
        held.older -= frame.nbytes


def _within(held: Held) -> None:
    """The forwards before the newest let go of their inputs, oldest first, until they hold at most `HELD_BYTES`."""
    while held.older > HELD_BYTES and len(held) > 1:
        _let_go(held)


def release(held: Held) -> None:
    """The site is decided: its frames let go of their inputs."""
    while held:
        held.popleft().held = None
    held.older = 0


def _grafted(t: torch.Tensor, inputs: set[int]) -> bool:
    return t.dtype in _FLOATING and id(t) not in inputs and not (t.is_leaf and t.requires_grad)


def _walk(value: Any, inputs: set[int], found: list[torch.Tensor] | None, replace: dict[int, torch.Tensor] | None,
          budget: list[int]) -> Any:
    """Collect the output's tensors to graft (``found``), or put the grafted ones in their place (``replace``): a
    tuple is rebuilt, a list, mapping, dataclass or plain object is changed in place. Raises `Opaque` for tensors in
    an object it cannot change, or past the budget."""
    budget[0] -= 1
    if budget[0] < 0:
        raise Opaque("too many objects in the output")
    if isinstance(value, torch.Tensor):
        if not _grafted(value, inputs):
            return value
        if found is not None:
            found.append(value)
            return value
        return replace.get(id(value), value) if replace is not None else value
    if value is None or isinstance(value, (str, bytes, int, float, bool, complex, torch.nn.Module, type)):
        return value
    if isinstance(value, tuple):
        items = [_walk(v, inputs, found, replace, budget) for v in value]
        if replace is None or all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)._make(items)
        return type(value)(items) if type(value) is not tuple else tuple(items)
    if isinstance(value, list):
        for i, v in enumerate(value):
            new = _walk(v, inputs, found, replace, budget)
            if new is not v:
                value[i] = new
        return value
    if isinstance(value, Mapping):
        for k, v in list(value.items()):
            new = _walk(v, inputs, found, replace, budget)
            if new is not v:
                if not isinstance(value, MutableMapping):
                    raise Opaque(f"an immutable mapping ({type(value).__name__})")
                value[k] = new  # a ModelOutput sets its attribute too
        return value
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            v = getattr(value, f.name, None)
            new = _walk(v, inputs, found, replace, budget)
            if new is not v:
                object.__setattr__(value, f.name, new)  # a frozen dataclass too
        return value
    if callable(value):
        return value
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        for k, v in list(attrs.items()):
            new = _walk(v, inputs, found, replace, budget)
            if new is not v:
                attrs[k] = new
        return value
    if isinstance(value, (set, frozenset)) and any(isinstance(v, torch.Tensor) for v in value):
        raise Opaque("tensors in a set")
    return value


_GONE = object()


def _weaken(value: Any, versions: list[tuple[weakref.ref[torch.Tensor], int]]) -> Any:
    """The inputs with each tensor replaced by a weak reference (in tuples, lists and dicts); other objects as they
    are."""
    if isinstance(value, torch.Tensor):
        ref = weakref.ref(value)
        versions.append((ref, value._version))
        return _Weak(ref)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_weaken(v, versions) for v in value)
    if type(value) is list:
        return [_weaken(v, versions) for v in value]
    if type(value) is dict:
        return {k: _weaken(v, versions) for k, v in value.items()}
    return value


class _Weak:
    __slots__ = ("ref",)

    def __init__(self, ref: weakref.ref[torch.Tensor]) -> None:
        self.ref = ref


def _strengthen(value: Any) -> Any:
    if isinstance(value, _Weak):
        tensor = value.ref()
        return _GONE if tensor is None else tensor
    if isinstance(value, (tuple, list)):
        items = [_strengthen(v) for v in value]
        return _GONE if any(v is _GONE for v in items) else type(value)(items)
    if isinstance(value, dict):
        items = {k: _strengthen(v) for k, v in value.items()}
        return _GONE if any(v is _GONE for v in items.values()) else items
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    stack, budget = [value], _BUDGET
    while stack and budget > 0:
        budget -= 1
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name, None) for f in dataclasses.fields(v))
    return found
