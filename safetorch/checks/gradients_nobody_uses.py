"""ST020: parameters that no optimizer holds keep accumulating gradients: a loss network (VGG for a perceptual or style
loss) whose parameters still require grad. Every backward computes their gradients and adds them to ``.grad``, which
nothing reads or resets: wasted compute and memory, and a ``.grad`` that grows without bound. ``eval()`` does not
change it: only ``requires_grad_(False)`` does.

How it is seen, precisely and cheaply: at a looked-at step (`safetorch._steps`: an optimizer's first 8 steps, then a
pair every 1024 backwards) a one-shot backward listener is armed. At the next backward the program makes, the autograd
graph is walked from the tensors it starts from (`_NODES` nodes at most), and the leaf ``nn.Parameter`` s it reaches
that require grad and that no live optimizer holds (the union of every optimizer's ``param_groups``) are the
suspects. Up to two of them whose ``.grad`` already exists are watched with ST011's *chain*: eight elements of the
gradient are copied, and a tensor hook on the parameter — called by each backward that reaches it, *before* the
gradient is accumulated — checks that ``.grad`` is still the same object and holds exactly what it would had nothing
reset it (the copy plus what every earlier backward of the watch added). The steps of every optimizer are counted by
a global step pre-hook that stands only during the watch. At the first step at which two steps have passed since the
watch began and every watched parameter was reached by two backwards at least, the chain is read one last time
(nothing reset it since the last backward either): intact, and not all zeros, it proves that nothing trains or resets
these gradients. ST020 at the user's ``backward()`` line of the backward that began the watch, once.

Any reset breaks the chain, and the rule stays silent: ``zero_grad()`` with ``set_to_none`` or not (of an optimizer
that holds them, or of a module that contains them), ``p.grad = None``, ``p.grad.zero_()``, ``p.grad.data.zero_()``
(invisible to version counters, not to values), gradients replaced, or read with ``torch.autograd.grad`` (whose hook
call adds nothing to ``.grad``: the values no longer follow). So is a watched parameter that an optimizer holds by the
time of the decision (built late, or given it with ``add_param_group``), one frozen since, or one gone. Silent by
construction: a GAN's generator reached by the discriminator's backward (its optimizer holds it), a second
optimizer's model, a frozen loss network (no ``AccumulateGrad`` node), adversarial inputs (leaf tensors that are not
``nn.Parameter``), a teacher or an EMA copy under ``no_grad`` (no graph), a model updated by hand and zeroed each step
(the chain breaks), and saliency read from gradients then zeroed. A backward that torch itself starts (a reentrant
checkpoint's) is not the program's: it arms nothing.

Cost: between looked-at steps nothing runs. A looked-at step arms a listener; the next backward walks the graph (a
few microseconds for a small model, bounded for a large one); only when unheld parameters with gradients are reached
does a watch start: two tensor hooks doing a few 8-element operations per backward and a step hook, for a few steps.
Hooks go when the watch ends (and the step hook, which torch does not let a step hook remove, at the next backward),
and the parameters are left as torch found them (`safetorch._hooks.LeafHook`; a watch given up from inside its own
hook leaves that to the next backward).
The decision, a bool on the gradient's device, is read through `safetorch._deferred`: on an accelerator the host
never waits for it. The module that owns the parameters, named in the message, is looked up only for a finding, among
the modules the ``backward()`` line's frame can see (its locals and globals, and one attribute level below them: no
``gc`` walk); nothing kept grows with the number of steps. When no such module holds them but a plain list (tuple,
dict) attribute of one does — layers never registered, so ``model.parameters()`` left them out of the optimizer — the
fix named is ``nn.ModuleList`` (``nn.ModuleDict``), not a freeze.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _backward, _deferred, _steps, _visible
from .._callsite import Spot, method_call
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._hooks import LeafHook, settle, untallied
from .._modes import train_effects
from .._patch import Registry
from .._report import internal_error, report_at
from .._rule import Rule

CODE = "ST020"
_K = 8  # elements compared per watched parameter
_PARAMS = 2  # parameters watched
_NODES = 20_000  # autograd nodes walked at most
_STEPS = 2  # steps of any optimizer a watch must outlast
_FIRES = 2  # backwards that must reach each watched parameter (the one that began the watch included)
_GIVE_UP_STEPS = 8  # a watch whose parameters backward no longer reaches ends after this many steps
#: Steps a watch must outlast when the suspects belong to a model the optimizer trains part of (``model.encoder`` while
#: ``model.head`` trains): progressive unfreezing gives them to an optimizer a few steps in (``add_param_group``).
_STEPS_PARTIAL = 8
_GIVE_UP_FIRES = 256  # ... and one that sees backwards but no step after this many
_OWNERS = 256  # names looked at for the owning module
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ACCUMULATE = getattr(torch._C._functions, "AccumulateGrad", None)


class GradientsNobodyUsesWarning(SafetorchWarning):
    """ST020: parameters that no optimizer holds keep accumulating gradients (a loss network never frozen)."""

    code = "ST020"


RULE = Rule("ST020", "gradients-nobody-uses", GradientsNobodyUsesWarning,
            "parameters no optimizer holds keep accumulating .grad (a loss network never frozen)")


@dataclass
class _Chain:
    param: weakref.ref[torch.Tensor]
    grad: weakref.ref[torch.Tensor]
    expected: torch.Tensor  # what the first _K elements of .grad hold if nothing reset them
    match: torch.Tensor  # bool, on the gradient's device: every backward found the values expected
    nonzero: torch.Tensor  # bool: the expected values were never all zeros (which a reset would also give)
    fired: int = 0
    handle: Any = field(default=None, repr=False)


@dataclass
class _Suspects:
    """What a finding says: where, and about which parameters (names of modules, never the modules themselves)."""

    spot: Spot
    method: str  # "backward" or "autograd.backward"
    count: int
    numel: int
    shape: tuple[int, ...]
    first: weakref.ref[torch.Tensor]
    owners: list[tuple[str, weakref.ref[torch.nn.Module]]]


@dataclass
class _Watch:
    suspects: _Suspects
    chains: list[_Chain]
    steps: int = 0
    over: bool = False
    partial: bool = False  # the suspects are part of a model whose other parameters an optimizer holds

    def stop(self) -> None:
        """Take the tensor hooks away (safe from inside one of them, and from a step hook)."""
        self.over = True
        for chain in self.chains:
            if chain.handle is not None:
                chain.handle.remove()
                chain.handle = None


class _State:
    """The one owner of ST020's state: armed for the next backward, or watching, or neither."""

    def __init__(self) -> None:
        self.armed = False
        self.listening = False
        self.watch: _Watch | None = None
        self.step_hook: Any = None  # the global step pre-hook's handle, while a watch stands
        self.stale_hook: Any = None  # a step hook to take away at the next backward (not from inside a step)
        #: The parameters found once, by id: not watched again (the finding is reported once per line anyway). Not a
        #: WeakSet: its membership test compares tensors with ==.
        self.found: dict[int, weakref.ref[torch.Tensor]] = {}

    def listen(self) -> None:
        if not self.listening:
            self.listening = True
            _backward.listen(CODE, before=_at_backward)

    def unlisten(self) -> None:
        if self.listening:
            self.listening = False
            _backward.unlisten(CODE)

    def end(self) -> None:
        """End the watch; its step hook goes at the next backward (torch iterates its hooks while calling one)."""
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.stop()
        if self.step_hook is not None:
            self.stale_hook, self.step_hook = self.step_hook, None
            self.listen()

    def clear(self) -> None:
        self.armed = False
        self.unlisten()
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        for handle in (self.step_hook, self.stale_hook):
            if handle is not None:
                handle.remove()
        self.step_hook = self.stale_hook = None
        self.found.clear()

    def was_found(self, p: torch.Tensor) -> bool:
        ref = self.found.get(id(p))
        return ref is not None and ref() is p

    def add_found(self, p: torch.Tensor) -> None:
        for key in [k for k, ref in self.found.items() if ref() is None]:
            del self.found[key]
        self.found[id(p)] = weakref.ref(p)


_state = _State()


def _head(t: torch.Tensor) -> torch.Tensor | None:
    """The first _K elements, or None when they cannot be read without a copy (or are not all here: a tensor
    subclass such as FSDP2's DTensor)."""
    if type(t) not in _PLAIN or t.layout is not torch.strided or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.detach().view(-1)[:_K]


def _held() -> set[int]:
    """The ids of every parameter a live optimizer holds."""
    return {id(p) for optimizer in _steps.optimizers() for group in optimizer.param_groups for p in group["params"]}


def _reached(tensors: Any) -> list[torch.nn.Parameter]:
    """The leaf parameters a backward from ``tensors`` accumulates into (within `_NODES` nodes of its graph)."""
    roots = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors or ())
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set(stack)
    found: list[torch.nn.Parameter] = []
    while stack:
        node = stack.pop()
        if type(node) is _ACCUMULATE or (_ACCUMULATE is None and type(node).__name__ == "AccumulateGrad"):
            variable = node.variable  # type: ignore[attr-defined]  (AccumulateGrad's leaf)
            if isinstance(variable, torch.nn.Parameter):
                found.append(variable)
            continue
        for following, _ in node.next_functions:
            if following is not None and following not in seen:
                if len(seen) >= _NODES:
                    return found
                seen.add(following)
                stack.append(following)
    return found


def _owners(frame: FrameType) -> list[tuple[str, weakref.ref[torch.nn.Module]]]:
    """The modules the frame sees (`safetorch._visible`), weakly: to name the owner if there is a finding."""
    return [(name, weakref.ref(module)) for name, module in _visible.modules(frame, _OWNERS)]


def _start(tensors: Any, frame: FrameType, method: str) -> None:
    """At the backward after a looked-at step: watch up to two unheld parameters it reaches whose ``.grad`` exists."""
    reached = _reached(tensors)
    if not reached:
        return
    held = _held()
    unheld = list({id(p): p for p in reached if p.requires_grad and id(p) not in held}.values())
    if not unheld or any(_state.was_found(p) for p in unheld):
        return  # nothing to watch, or what was found already
    chains: list[_Chain] = []
    for p in unheld:
        g = p.grad
        if g is None or g.requires_grad or g.is_sparse:
            continue
        head = _head(g)
        if head is None or g.shape != p.shape:
            continue
        snapshot = head.clone()
        chains.append(_Chain(weakref.ref(p), weakref.ref(g), snapshot, snapshot.eq(snapshot).all(),
                             snapshot.ne(0).any()))
        if len(chains) == _PARAMS:
            break
    if not chains:
        return
    suspects = _Suspects(Spot(frame), method, len(unheld), sum(p.numel() for p in unheld), tuple(unheld[0].shape),
                         weakref.ref(unheld[0]), _owners(frame))
    watch = _state.watch = _Watch(suspects, chains, partial=_partial(suspects, held))
    for chain in chains:
        param = chain.param()
        if param is None:
            continue

        chain.handle = LeafHook(param, lambda incoming, watch=watch, chain=chain: _on_backward(watch, chain, incoming))
    if _state.step_hook is None:
        _state.step_hook = untallied(register_optimizer_step_pre_hook, _stepped)


def _partial(suspects: _Suspects, held: set[int]) -> bool:
    """Is the first suspect part of a module the frame sees whose other parameters an optimizer holds?"""
    first = suspects.first()
    for _, ref in suspects.owners:
        module = ref()
        if module is not None and first is not None:
            params = list(module.parameters())
            if any(p is first for p in params) and any(id(p) in held for p in params):
                return True
    return False


def _on_backward(watch: _Watch, chain: _Chain, incoming: torch.Tensor) -> None:
    """A backward reached a watched parameter; its gradient is not accumulated yet."""
    try:
        if watch.over or is_compiling():
            return
        param, grad = chain.param(), chain.grad()
        now = _head(grad) if grad is not None else None
        add = _head(incoming)
        if (param is None or grad is None or param.grad is not grad or now is None or add is None
                or add.shape != now.shape or add.dtype != now.dtype):
            _give_up(watch)  # reset to None, replaced, or not comparable: nothing to prove
            return
        chain.match = chain.match & (now == chain.expected).all()
        chain.nonzero = chain.nonzero & chain.expected.ne(0).any()
        chain.expected = chain.expected + add
        chain.fired += 1
        if chain.fired > _GIVE_UP_FIRES:
            _give_up(watch)
    except Exception as exc:
        _give_up(watch)
        internal_error(CODE, exc)


def _give_up(watch: _Watch) -> None:
    if _state.watch is watch:
        _state.end()
    else:
        watch.stop()


def _stepped(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The global step pre-hook, while a watch stands: count the step, and decide once the watch has lasted."""
    __tracebackhide__ = True  # noqa: F841
    try:
        watch = _state.watch
        if watch is None or is_compiling():
            return
        watch.steps += 1
        need = _STEPS_PARTIAL if watch.partial else _STEPS
        if watch.steps >= need and all(chain.fired >= _FIRES for chain in watch.chains):
            _state.end()
            _decide(watch)
        elif watch.steps >= _GIVE_UP_STEPS + need - _STEPS:
            _state.end()
        settle()  # a step hook: no backward runs
    except Exception as exc:  # strict-mode findings pass through internal_error
        _state.end()
        internal_error(CODE, exc)


def _decide(watch: _Watch) -> None:
    """Queue the decision: every chain intact up to now, and one of them not all zeros."""
    held = _held()
    intact: torch.Tensor | None = None
    nonzero: torch.Tensor | None = None
    for chain in watch.chains:
        param, grad = chain.param(), chain.grad()
        if param is None or grad is None or param.grad is not grad or not param.requires_grad or id(param) in held:
            return  # reset to None, replaced, frozen since, or an optimizer holds it now
        now = _head(grad)
        if now is None or now.shape != chain.expected.shape:
            return
        ok = chain.match & (now == chain.expected).all()
        some = chain.nonzero & chain.expected.ne(0).any()
        intact = ok if intact is None else intact & ok
        nonzero = some if nonzero is None else nonzero | some
    if intact is not None and nonzero is not None:
        _deferred.check(intact & nonzero, _decided, watch.suspects, CODE)


def _decided(unused: Any, suspects: _Suspects) -> None:
    """The device has computed the decision (at once on the CPU)."""
    if unused:
        first = suspects.first()
        if first is not None:
            _state.add_found(first)
        spot = suspects.spot
        report_at(CODE, spot.f_code.co_filename, spot.f_lineno, spot.f_globals, lambda: _message(suspects))


def _owner(suspects: _Suspects) -> tuple[str, torch.nn.Module] | None:
    """The shallowest module the frame saw whose parameters include the first suspect and none an optimizer holds."""
    target = suspects.first()
    if target is None:
        return None
    held = _held()
    for name, ref in suspects.owners:
        module = ref()
        if module is None or not any(p is target for p in module.parameters()):
            continue
        for path, sub in module.named_modules():
            params = list(sub.parameters())
            if any(p is target for p in params) and not any(id(p) in held for p in params):
                return (f"{name}.{path}" if path else name), sub
    return None


@dataclass
class _Unregistered:
    """Modules kept in a plain Python container attribute of a module: ``nn.Module`` registers none of them."""

    label: str  # model.layers
    attribute: str  # layers
    holder: str  # the class whose __init__ assigns it
    kind: str  # list, tuple or dict
    modules: list[torch.nn.Module]


def _container_modules(value: Any) -> list[torch.nn.Module]:
    items = value.values() if isinstance(value, dict) else value
    return [m for m in items if isinstance(m, torch.nn.Module)]


def _unregistered(suspects: _Suspects) -> _Unregistered | None:
    """The plain list (tuple, dict) attribute of a module the frame saw that holds the first suspect: layers kept in
    ``self.layers = [nn.Linear(...), ...]`` are never registered, so its ``parameters()`` — what the optimizer was
    given — leave them out. Looked at only for a finding."""
    target = suspects.first()
    if target is None:
        return None
    for name, ref in suspects.owners:
        root = ref()
        if root is None:
            continue
        for path, sub in root.named_modules():
            for attribute, value in list(vars(sub).items())[:_OWNERS]:
                if not isinstance(value, (list, tuple, dict)) or len(value) > _OWNERS:
                    continue
                modules = _container_modules(value)
                if any(p is target for m in modules for p in m.parameters()):
                    label = ".".join(part for part in (name, path, attribute) if part)
                    return _Unregistered(label, attribute, type(sub).__name__, type(value).__name__, modules)
    return None


def _message(suspects: _Suspects) -> str:
    spot = suspects.spot
    if suspects.method == "backward":
        receiver, text = method_call(spot, "backward", 1 << 30, limit=60)
        call = f"{receiver}.backward()" if receiver else text or "loss.backward()"
    else:
        call = "torch.autograd.backward()"
    what = "1 parameter" if suspects.count == 1 else f"{suspects.count} parameters"
    owner = _owner(suspects)
    held = _unregistered(suspects) if owner is None else None
    if held is not None:
        kinds = sorted({type(m).__name__ for m in held.modules})
        root = held.label.split(".")[0]
        container = "nn.ModuleDict({...})" if held.kind == "dict" else "nn.ModuleList([...])"
        return (f"{CODE} {call} computes gradients for {held.label} (a plain Python {held.kind} of "
                f"{len(held.modules)} {'/'.join(kinds)}, {what}, {suspects.numel:,} elements) that no optimizer "
                f"holds: nn.Module registers no module kept in a plain {held.kind}, so {root}.parameters() leaves "
                f"them out and they are never trained (nor moved by .to(), nor saved by state_dict()), while each "
                f"backward adds to their .grad, which nothing reads or resets. Write: self.{held.attribute} = "
                f"{container} in {held.holder}.__init__, then build the optimizer from {root}.parameters()")
    if owner is not None:
        name, module = owner
        whose = f"{name} (a {type(module).__name__}, {what}, {suspects.numel:,} elements)"
        fix = f"{name}.requires_grad_(False)"
        mode = ""
        if train_effects(module):  # its dropout/BatchNorm change its numbers in training mode
            fix += ".eval()"
            mode = " Its dropout/BatchNorm layers are in training mode too."
        trained = f"{name}.parameters()"
    else:
        shape = "×".join(str(n) for n in suspects.shape) or "0-dim"
        whose = f"{what} ({suspects.numel:,} elements, the first of shape {shape})"
        fix, mode = "<module>.requires_grad_(False), on the module that holds them,", ""
        trained = "them"
    return (f"{CODE} {call} computes gradients for {whose} that no optimizer holds: each backward adds them to "
            f".grad, which nothing reads or resets, so it grows every step and its compute and memory are spent for "
            f"nothing (eval() does not turn gradients off).{mode} Write: {fix} once, after building it (or pass "
            f"{trained} to an optimizer if it is meant to be trained)")


def _look(optimizer: Optimizer, look: int, caller: FrameType, more: bool) -> None:
    """A looked-at step: arm the listener for the next backward, unless a watch of live parameters stands."""
    watch = _state.watch
    if watch is not None and any(chain.param() is None for chain in watch.chains):
        _state.end()  # the module it watched is gone
    if _state.watch is None and not _state.armed:
        _state.armed = True
        _state.listen()


def _look_closure(optimizer: Optimizer, closure: Any, caller: FrameType) -> Any:
    """A looked-at ``step(closure)`` (LBFGS): its backwards run inside the step, after the pre-hook; arm the listener
    for the first of them all the same. The closure is the user's, unchanged."""
    try:
        _look(optimizer, 0, caller, False)
    except Exception as exc:
        internal_error(CODE, exc)
    return closure


def _at_backward(tensors: Any) -> None:
    """The one-shot backward listener: take a stale step hook away, and begin a watch when armed."""
    try:
        settle()  # the hooks of a watch given up from inside one of them
        stale, _state.stale_hook = _state.stale_hook, None
        if stale is not None:
            stale.remove()
        armed, _state.armed = _state.armed, False
        _state.unlisten()
        if not armed or is_compiling() or _state.watch is not None:
            return
        caller = _backward.caller()
        frame, method = _backward.origin(caller) if caller is not None else (None, "")
        if frame is not None:  # None: torch's own backward (a reentrant checkpoint's), not the program's
            _start(tensors, frame, method)
    except Exception as exc:
        internal_error(CODE, exc)


def reset() -> None:
    """Forget the watch and the armed listener (tests; `uninstall` does the same)."""
    _state.clear()


def install(registry: Registry) -> None:
    _steps.listen(CODE, _look, closure=_look_closure)


def uninstall() -> None:
    _steps.unlisten(CODE)
    _deferred.clear(CODE)
    reset()
    settle()
