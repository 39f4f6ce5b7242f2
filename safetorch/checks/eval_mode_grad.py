"""ST003 and ST008: an eval-mode model called at top level with autograd on. Observe first, then act.

People call ``model.eval()`` and believe it disables gradients; it only switches dropout and BatchNorm, and a
validation loop without ``torch.no_grad()`` keeps every activation for a backward that never comes (ST003). The
opposite mistake is as common and as silent: a model that is still in eval mode while it trains, because a library
returned it that way (``from_pretrained``) or ``model.train()`` was forgotten after a validation pass (ST008).

What happens, per call site (the user's line, the call instruction on it, and the module):
1. The first eval-mode forward at a site runs **exactly as written**, with grad, and is watched: does its output's
   graph reach a leaf that is not a parameter of this module (an input at any depth, another model's parameters, a
   global tensor)? Does the forward itself call ``torch.autograd.grad``/``backward`` or register a tensor hook? Does
   a backward later go through any node of its graph (its output, or activations a hook captured)?
2. At the next forward there, the site is decided. If anything above was seen, the site needs gradients and is never
   touched again. Otherwise it is an evaluation: ST003 is reported, and from this forward on the site runs under
   ``no_grad`` (except a forward whose inputs require grad, at any depth, which runs as written).
3. When a backward reached such a forward and an optimizer step then updates parameters of that module that hold
   gradients, ST008 is reported once at the forward's line, naming who put the module in eval mode.
4. Should a backward still go through the watched graph of a site decided as an evaluation (its later forwards gave
   no gradients), it fails with a `SafetorchError` that says so, instead of training on a silently partial gradient.
   A "does not require grad" error right after one of our no_grad forwards says why when that forward's output is
   still alive; otherwise torch's error keeps its type and message, with a note.

Design rules:
- Nothing global on the forward path: the module the program puts in eval mode (its ``eval()`` called directly, not
  a child that a parent's ``train()`` recursed into) gets a guard in its own ``__dict__`` under ``_call_impl``, which
  ``Module._wrapped_call_impl`` looks up on the instance. Calling through the guard keeps torch's hook-free fast path,
  and grad mode is restored in a ``finally``: KeyboardInterrupt and SystemExit included. A guarded module called from
  inside another module's forward (frozen BatchNorm in a training net) loses its guard at that first call: a training
  parent decides for its children. ``train()``, or ``training`` set back to True by assignment, drops the guard.
- Costs are O(1) in the number of eval-mode modules: grad-mode switches and optimizer steps touch no module; ST008's
  step hook exists only while a site waits for its first step.
- The guard never reaches a pickle: ``Module.__getstate__`` leaves it out (except for ``copy.deepcopy``, whose copy
  gets its own guard), so a model saved with safetorch holds the bytes of the same model saved without it. DataParallel
  replicas are made without it (their forwards run inside DataParallel's).
- Explicit grad mode (``with torch.enable_grad()``, ``with torch.set_grad_enabled(True)``, ``inference_mode(False)``,
  each also as a decorator) switches the check off for its scope only, per thread, as torch's grad mode is. The
  function form ``torch.set_grad_enabled(True)`` is not a scope: Lightning's fit loop calls it, and it leaves nothing.
- tracing (``torch.jit.trace``), ``torch.compile``/export and ``torch.func`` transforms pass straight through.
- All state lives in one `_Sites` object that `reset` and `uninstall` clear; a per-line
  ``# safetorch: ignore[ST003]`` leaves that site alone.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import sysconfig
import threading
import weakref
from collections.abc import Mapping
from types import CodeType, FrameType
from typing import Any

import torch
from torch.autograd import grad_mode
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _backward
from .._callsite import callee, getline
from .._compat import is_compiling
from .._exceptions import SafetorchError, SafetorchWarning
from .._patch import MethodPatch, Registry, registry
from .._report import internal_error, is_internal, report_at, suppressed, user_frame
from .._rule import Rule

CODE = "ST003"


class EvalModeGradWarning(SafetorchWarning):
    """ST003: an eval-mode forward ran with autograd on, for nothing."""

    code = "ST003"


RULE = Rule("ST003", "eval-mode-grad", EvalModeGradWarning,
            "forward of an eval-mode model with autograd on, for nothing")
TRAINING_CODE = "ST008"
GROUP = "eval-mode"  # the patches ST003 and ST008 share: in place while either is installed

_call_impl_code = torch.nn.Module._call_impl.__code__
_module_call_impl = torch.nn.Module._call_impl
_is_compiling = is_compiling
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_tracing_state = torch._C._get_tracing_state
_functorch = getattr(torch._C, "_functorch", None)
_peek_interpreter = getattr(_functorch, "peek_interpreter_stack", None) or (lambda: None)

_GRAPH_BUDGET = 200_000  # autograd nodes walked per watched forward; beyond it, assume the graph is needed
_INPUT_BUDGET = 1_000  # objects looked at per forward when searching the inputs for a tensor requiring grad
_ST008_PATIENCE = 16  # optimizer steps a site waits for one that trains its module before ST008 gives up


#: Where ``eval()`` was called, as recorded at the call (`_origin`) and worded only for a finding (`_describe`): the
#: calling code and its offset, its module's ``__name__``, and the program's code and offset that called it (None
#: when the call stands at a module's top level).
Origin = tuple[CodeType, int, str, "tuple[CodeType, int] | None"]


class _Thread(threading.local):
    explicit = False  # inside an explicit enable_grad / set_grad_enabled(True) / inference_mode(False) scope
    #: Sites whose first forward this thread is running (a forward that calls autograd itself needs grad).
    watching: list[_Site]
    #: The site whose forward ran under our no_grad most recently, since the last backward began (for its error).
    nograd: _Site | None = None
    #: At the start of a backward: that site, and whether the backward starts from one of its live outputs.
    suspect: tuple[_Site, bool] | None = None

    def __init__(self) -> None:
        self.watching = []


_thread = _Thread()
_codes: set[str] = set()  # which of ST003 / ST008 are installed


# --- sites -----------------------------------------------------------------------------------------------------


class _Site:
    """One call site of one module: its decision and what the watched first forward showed."""

    __slots__ = ("backward", "filename", "globals", "kind", "lineno", "module", "name", "needs", "outputs",
                 "state", "st008", "watched", "__weakref__")

    WATCHING, TRAIN, EVAL, FROZEN = "watching", "train", "eval", "frozen"

    def __init__(self, module: torch.nn.Module, frame: FrameType) -> None:
        self.module = weakref.ref(module)
        self.filename = frame.f_code.co_filename
        self.lineno = frame.f_lineno
        self.globals = frame.f_globals
        self.name = callee(frame) or "model"
        self.kind = type(module).__name__
        self.state = _Site.WATCHING
        self.watched = False  # its first forward ran (watched); the next one decides
        self.needs: str | None = None  # why the site needs gradients, once known
        self.backward = False  # a backward reached the watched forward's output or parameters
        self.outputs: list[weakref.ref[torch.Tensor]] = []  # the last no_grad forward's outputs
        self.st008 = 0  # optimizer steps seen while waiting for ST008

    def needs_grad(self, reason: str) -> None:
        if self.needs is None:
            self.needs = reason


class _Sites:
    """The one owner of ST003/ST008 state: sites, guarded modules, the ST008 queue and its step hook."""

    def __init__(self) -> None:
        self.sites: dict[tuple[str, int, int, int], _Site] = {}
        #: Modules guarded because the program called their eval(): id -> (module, who put it in eval mode).
        self.guarded: dict[int, tuple[weakref.ref[torch.nn.Module], Origin | None]] = {}
        self.pending: list[_Site] = []  # sites waiting for an optimizer step (ST008)
        self.step_hook: Any = None
        self.lock = threading.Lock()

    @staticmethod
    def key(module: torch.nn.Module, frame: FrameType) -> tuple[str, int, int, int]:
        return (frame.f_code.co_filename, frame.f_lineno, frame.f_lasti, id(module))

    def site(self, module: torch.nn.Module, frame: FrameType) -> _Site | None:
        site = self.sites.get(self.key(module, frame))
        if site is not None and site.module() is module:
            return site
        return None

    def add(self, module: torch.nn.Module, frame: FrameType) -> _Site:
        key = self.key(module, frame)
        site = _Site(module, frame)
        with self.lock:
            if len(self.sites) >= 4096:  # drop the sites of modules that are gone, and then the older half
                sites = {k: s for k, s in self.sites.items() if s.module() is not None}
                if len(sites) >= 2048:
                    sites = dict(list(sites.items())[len(sites) // 2:])
                self.sites = sites
            self.sites[key] = site
        return site

    def clear(self) -> None:
        with self.lock:
            self.sites.clear()
            self.pending.clear()
            if self.step_hook is not None:
                self.step_hook.remove()
                self.step_hook = None
        _thread.nograd = _thread.suspect = None


_sites = _Sites()


# --- the guard -------------------------------------------------------------------------------------------------


class _Guard:
    """Stands in the module's ``__dict__`` as ``_call_impl``; `Module._wrapped_call_impl` calls it with the forward's
    arguments. Holds its module weakly, so that an eval-mode model is freed as soon as the program drops it."""

    __slots__ = ("module", "__weakref__")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        module = self.module()
        if module is None:  # a copy of a dead module's __dict__: nothing to guard
            raise RuntimeError("safetorch: a module guard outlived its module")
        if module.training or not _codes:
            _unguard(module, self)
            return _module_call_impl(module, *args, **kwargs)
        if not _is_grad_enabled() or _thread.explicit:
            return _module_call_impl(module, *args, **kwargs)
        return _eval_forward(module, self, args, kwargs)

    def __reduce__(self) -> Any:
        """Never pickled with a module (see `_getstate`), unless a subclass's own ``__getstate__`` copies the
        ``__dict__`` without ``Module.__getstate__``: then it loads as a plain ``Module._call_impl`` bound to its
        module, which needs no safetorch and behaves as the class's."""
        module = self.module()
        if module is None:
            return (type(None), ())
        return (functools.partial, (type(module)._call_impl, module))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """The copy of a guarded module gets a guard of its own (``copy.deepcopy`` memoises the copy first)."""
        module = self.module()
        copy = memo.get(id(module)) if module is not None else None
        if not isinstance(copy, torch.nn.Module):
            return self  # the guard copied alone, not with its module
        _remember(copy, _sites.guarded.get(id(module), (None, None))[1])
        return _Guard(copy)


def _guard_of(module: torch.nn.Module) -> _Guard | None:
    guard = module.__dict__.get("_call_impl")
    return guard if isinstance(guard, _Guard) else None


def _guard(module: torch.nn.Module, origin: Origin | None) -> None:
    guard = _guard_of(module)
    if guard is None or guard.module() is not module:
        module.__dict__["_call_impl"] = _Guard(module)
    _remember(module, origin)


def _remember(module: torch.nn.Module, origin: Origin | None) -> None:
    key, guarded = id(module), _sites.guarded  # bound now: the callback may run at interpreter exit
    guarded[key] = (weakref.ref(module, lambda _, key=key, guarded=guarded: guarded.pop(key, None)), origin)


def _unguard(module: torch.nn.Module, guard: _Guard | None = None) -> None:
    d = module.__dict__
    if isinstance(d.get("_call_impl"), _Guard) and (guard is None or d["_call_impl"] is guard):
        del d["_call_impl"]
    _sites.guarded.pop(id(module), None)


def _nested(frame: FrameType | None) -> bool:
    """True when another module's ``_call_impl`` runs above this call: a parent's forward called this module."""
    while frame is not None:
        if frame.f_code is _call_impl_code:
            return True
        frame = frame.f_back
    return False


def _passthrough() -> bool:
    return bool(_is_compiling() or _tracing_state() or _peek_interpreter() is not None)


def _eval_forward(module: torch.nn.Module, guard: _Guard, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An eval-mode forward with grad on and not asked for: watch it, run it under no_grad, or leave it alone."""
    __tracebackhide__ = True  # noqa: F841
    site = None
    try:
        if not _passthrough():
            site = _site_for(module, guard, sys._getframe(2))
    except Exception as exc:
        internal_error(CODE, exc)
    if site is None or site.state is _Site.TRAIN or site.state is _Site.FROZEN:
        return _module_call_impl(module, *args, **kwargs)
    if site.state is _Site.WATCHING:
        if not site.watched:
            return _watched(module, site, args, kwargs)
        _decide(site)
        if site.state is not _Site.EVAL:
            return _module_call_impl(module, *args, **kwargs)
    # Every forward counts in the summary, and a warning first hit under an ignore filter is shown later.
    report_at(CODE, site.filename, site.lineno, site.globals, lambda: _message(site))  # raises in strict mode
    if _inputs_require_grad(args, kwargs):
        return _module_call_impl(module, *args, **kwargs)
    _set_grad_enabled(False)
    try:
        output = _module_call_impl(module, *args, **kwargs)
    finally:
        _set_grad_enabled(True)
    _keep_outputs(site, output)
    return output


def _site_for(module: torch.nn.Module, guard: _Guard, frame: FrameType) -> _Site | None:
    caller = user_frame(frame)
    if caller is None:
        return None
    site = _sites.site(module, caller)
    if site is not None:
        return site
    if _nested(frame):
        _unguard(module, guard)  # a child of a running forward: its parent decides
        return None
    site = _sites.add(module, caller)
    if not any(p.requires_grad for p in module.parameters()):
        site.state = _Site.FROZEN  # nothing to record, nothing to save
    return site


def _watched(module: torch.nn.Module, site: _Site, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The first forward at a site: exactly as written, with grad; then look at what its output's graph reaches."""
    __tracebackhide__ = True  # noqa: F841
    site.watched = True
    _listen_to_backwards()  # a backward inside this forward means its graph is needed
    _thread.watching.append(site)
    try:
        output = _module_call_impl(module, *args, **kwargs)
    finally:
        _thread.watching.remove(site)
    try:
        _inspect(module, site, output)
    except Exception as exc:
        site.needs_grad("internal")  # when in doubt, never touch the site
        internal_error(CODE, exc)
    return output


def _tensors(value: Any, budget: list[int]) -> list[torch.Tensor]:
    """The tensors in a forward's output or inputs, at any depth: containers, mappings (ModelOutput), dataclasses."""
    found: list[torch.Tensor] = []
    stack = [value]
    seen: set[int] = set()
    while stack:
        budget[0] -= 1
        if budget[0] < 0:
            break
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            found.append(v)
            continue
        if id(v) in seen or v is None or isinstance(v, (str, bytes, int, float, bool, torch.nn.Module)):
            continue
        seen.add(id(v))
        if isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name, None) for f in dataclasses.fields(v))
        elif hasattr(v, "__dict__") and not isinstance(v, type) and not callable(v):
            stack.extend(vars(v).values())
    return found


def _inputs_require_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    budget = [_INPUT_BUDGET]
    found = _tensors((args, kwargs), budget)
    return budget[0] < 0 or any(t.requires_grad for t in found)


def _inspect(module: torch.nn.Module, site: _Site, output: Any) -> None:
    """Walk the watched output's graph. A leaf that is not our parameter means the graph is needed; every other node
    gets a pre-hook, so that a backward through any part of this forward's graph (its output, or activations that
    a hook captured) is seen. The hooks live as long as that graph; parameters' accumulators, shared with every other
    graph of the module, get none."""
    params = {id(p) for p in module.parameters()}
    reached = _Reached(site)
    stack = list({t.grad_fn for t in _tensors(output, [_INPUT_BUDGET]) if t.grad_fn is not None})
    seen = set(stack)
    budget = _GRAPH_BUDGET
    while stack:
        budget -= 1
        if budget < 0:
            site.needs_grad("a graph too large to inspect")
            return
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            if id(variable) not in params:
                site.needs_grad("a tensor that is not its parameter")
                return
            continue
        node.register_prehook(reached)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)


class _Reached:
    """A pre-hook on the nodes of a watched forward's graph: a backward went through it. Lives with that graph."""

    __slots__ = ("site",)

    def __init__(self, site: _Site) -> None:
        self.site = weakref.ref(site)

    def __call__(self, grad_outputs: Any) -> None:
        site = self.site()
        if site is not None and _codes and not (site.backward and site.state is not _Site.EVAL):
            try:
                _backward_reached(site)
            except Exception as exc:  # our SafetorchError goes through
                internal_error(CODE, exc)
        return None


def _backward_reached(site: _Site) -> None:
    __tracebackhide__ = True  # noqa: F841
    site.needs_grad("a backward")
    if site.state is _Site.EVAL:
        raise SafetorchError(_lost_message(site), code=CODE, filename=site.filename, lineno=site.lineno)
    if not site.backward:
        site.backward = True
        if TRAINING_CODE in _codes:
            _arm_st008(site)


def _decide(site: _Site) -> None:
    """The second forward at a site: it needs gradients, or it is an evaluation (ST003, no_grad from now on)."""
    __tracebackhide__ = True  # noqa: F841
    if site.needs is not None:
        site.state = _Site.TRAIN
        return
    # ST003 reports it at each forward from now on; with ST008 alone, or on a line that says
    # `# safetorch: ignore[ST003]`, observe and never change anything.
    evaluate = CODE in _codes and not suppressed(CODE, site.filename, site.lineno, site.globals)
    site.state = _Site.EVAL if evaluate else _Site.TRAIN


def _keep_outputs(site: _Site, output: Any) -> None:
    try:
        site.outputs = [weakref.ref(t) for t in _tensors(output, [64])]
        _thread.nograd = site
        _listen_to_backwards()
    except Exception as exc:
        internal_error(CODE, exc)


def _message(site: _Site) -> str:
    return (f"{CODE} {site.name} ({site.kind}) is in eval mode with autograd on: eval() does not disable gradients, "
            f"so each forward here would keep every activation for a backward that never comes. safetorch watched "
            f"the first forward at this line, saw nothing use its graph, and runs the next ones under "
            f"torch.no_grad(). Write: `with torch.no_grad():` around the evaluation (or {site.name}.train() if you "
            f"train through this forward)")


def _ways_out(site: _Site) -> str:
    return (f"To train through it: call {site.name}.train() before the forward, or wrap the forward in "
            f"`with torch.enable_grad():`, or end that line with `# safetorch: ignore[ST003]`, or switch this check "
            f"off with SAFETORCH_IGNORE=ST003.")


def _lost_message(site: _Site) -> str:
    return (f"{CODE} backward() reached the output of {site.name} ({site.kind}) at {site.filename}:{site.lineno}, a "
            f"forward of an eval-mode model that safetorch took for an evaluation: nothing had used the graph of its "
            f"first forward when the second ran, so the later forwards there ran under torch.no_grad() and give no "
            f"gradient. {_ways_out(site)}")


# --- ST008: an optimizer trains a model that is in eval mode ---------------------------------------------------


def _arm_st008(site: _Site) -> None:
    with _sites.lock:
        if site in _sites.pending:
            return
        site.st008 = 0
        _sites.pending.append(site)
        if _sites.step_hook is None:
            _sites.step_hook = register_optimizer_step_pre_hook(_step_pre_hook)


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        held = {id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
        found, waiting = [], []
        for site in list(_sites.pending):
            module = site.module()
            site.st008 += 1
            if module is not None and any(id(p) in held for p in module.parameters()):
                found.append((site, module))
            elif module is not None and site.st008 < _ST008_PATIENCE:
                waiting.append(site)
        with _sites.lock:
            _sites.pending = waiting
            if not waiting and _sites.step_hook is not None:
                _sites.step_hook.remove()
                _sites.step_hook = None
    except Exception as exc:
        internal_error(TRAINING_CODE, exc)
        return
    for site, module in found:
        report_at(TRAINING_CODE, site.filename, site.lineno, site.globals,
                  lambda s=site, m=module: _st008_message(s, m))


def _st008_message(site: _Site, module: torch.nn.Module) -> str:
    origin = _describe(_sites.guarded.get(id(module), (None, None))[1])
    return (f"{TRAINING_CODE} {site.name} ({site.kind}) is trained in eval mode: an optimizer updates its parameters, "
            f"but dropout is off and BatchNorm uses its running statistics. It was put in eval mode by {origin}. "
            f"Write: {site.name}.train() before the training loop (or SAFETORCH_IGNORE=ST008 if you train it in eval "
            f"mode on purpose)")


# --- who put a module in eval mode ---------------------------------------------------------------------------

_LIBRARY_DIRS = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_paths().get(k) for k in ("purelib", "platlib", "stdlib")} if p
)


_libraries: dict[str, bool] = {}


def _library(code: Any) -> bool:
    """True for code of an installed library or the standard library (cached by file name: every eval() asks)."""
    filename = code.co_filename
    answer = _libraries.get(filename)
    if answer is None:
        answer = filename.startswith("<frozen") or os.path.abspath(filename).startswith(_LIBRARY_DIRS)
        if len(_libraries) < 4096:
            _libraries[filename] = answer
    return answer


def _origin(frame: FrameType | None) -> Origin | None:
    """Who called ``eval()``, recorded cheaply at the call (every eval() asks; worded by `_describe`, only for a
    finding): the program's own line, or a library function (``from_pretrained``) and the program's line that called
    it. Code objects and offsets only: a line number costs a walk of the line table."""
    frame = user_frame(frame)
    while frame is not None and frame.f_code.co_name in ("train", "eval"):  # a subclass's own train()/eval()
        frame = user_frame(frame.f_back)
    if frame is None:
        return None
    code = frame.f_code
    if code.co_name == "<module>":
        return code, frame.f_lasti, "", None
    outer = frame.f_back
    while outer is not None and (is_internal(outer.f_code) or _library(outer.f_code)
                                 or outer.f_code.co_filename == code.co_filename):
        outer = outer.f_back
    return code, frame.f_lasti, frame.f_globals.get("__name__", "?"), \
        (outer.f_code, outer.f_lasti) if outer is not None else None


def _line_at(code: CodeType, lasti: int) -> int:
    """The line of the instruction at ``lasti``, as ``frame.f_lineno`` gives it."""
    return next((line for start, end, line in code.co_lines() if start <= lasti < end and line is not None),
                code.co_firstlineno)


def _describe(origin: Origin | None) -> str:
    if origin is None:
        return "an eval() call"
    code, lasti, module, outer = origin
    filename, lineno = code.co_filename, _line_at(code, lasti)
    name = f"{module}.{getattr(code, 'co_qualname', code.co_name)}()" if module else ""
    called = f"{outer[0].co_filename}:{_line_at(*outer)}" if outer is not None else ""
    where = f"{filename}:{lineno}"
    if module and _library(code):
        text = f"{name} at {where}"
    else:
        line = getline(filename, lineno).strip() or "eval()"
        text = f"`{line}` at {where}" + (f" in {name}" if name else "")
    return text + (f", called from {called}" if called else "")


# --- patches ---------------------------------------------------------------------------------------------------

#: The threads in which a ``train()`` call is running, by ident: a call made while one runs is a child's. A dict, not
#: a ``threading.local``: a child's call pays one lookup, where a thread-local's attributes cost three times as much.
_training_threads: dict[int, bool] = {}
_get_ident = threading.get_ident


def _train(original: Any) -> Any:
    """``Module.train``, as a plain function (see `Registry.replace`): torch's ``train()`` calls it again for every
    child. The guard goes on the module whose eval() the program called, not on the children it recurses into: an
    ``eval()`` made while another runs in this thread is a child's, and returns at once. ``train()`` needs no such
    bookkeeping (its cost per call is torch's and one dict lookup): each module, children included, takes off a
    guard of its own (a frozen BatchNorm's, from an eval() of its own)."""

    def train(self: Any, mode: bool = True) -> Any:
        if mode is True:  # train(): nothing to tell apart, only a guard to take off (each child its own)
            result = original(self, mode)
            try:
                if "_call_impl" in self.__dict__ and self.training:
                    _unguard(self)
            except Exception as exc:
                internal_error(CODE, exc)
            return result
        ident = _get_ident()
        if ident in _training_threads:
            return original(self, mode)
        _training_threads[ident] = True
        try:
            result = original(self, mode)
        finally:
            del _training_threads[ident]
        try:
            if self.training:
                if "_call_impl" in self.__dict__:
                    _unguard(self)
            elif not _is_compiling() and not isinstance(self, torch.jit.ScriptModule):
                _guard(self, _origin(sys._getframe(1)))
        except Exception as exc:
            internal_error(CODE, exc)
        return result

    return train


_deepcopy_code = __import__("copy").deepcopy.__code__


def _getstate(original: Any) -> Any:
    """``Module.__getstate__``: the guard stays out of pickles and shallow copies; ``copy.deepcopy`` gives the copy its
    own guard."""

    def __getstate__(self: Any) -> Any:
        state = original(self)
        if isinstance(state, dict) and isinstance(state.get("_call_impl"), _Guard):
            caller = sys._getframe(1)
            if caller.f_code is not _deepcopy_code:
                del state["_call_impl"]
        return state

    return __getstate__


def _replicate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DataParallel copies each module's ``__dict__`` into its replicas: they run without the guard."""
    replica = wrapped(*args, **kwargs)
    if isinstance(replica.__dict__.get("_call_impl"), _Guard):
        del replica.__dict__["_call_impl"]
    return replica


def _enter_explicit(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``__enter__`` of a scope that switches grad on (or inference mode off) on purpose: ST003 is off inside it."""
    result = wrapped(*args, **kwargs)
    if isinstance(instance, grad_mode.inference_mode):
        explicit = getattr(instance, "mode", True) is False
    else:  # enable_grad, or set_grad_enabled(mode)
        explicit = bool(getattr(instance, "mode", True))
    if explicit:
        instance._safetorch_explicit = _thread.explicit
        _thread.explicit = True
    return result


def _exit_explicit(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    previous = instance.__dict__.pop("_safetorch_explicit", None)
    if previous is not None:
        _thread.explicit = previous
    return wrapped(*args, **kwargs)


def _autograd_in_forward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.autograd.grad`` / ``Tensor.register_hook`` inside a watched forward: that site needs its graph."""
    for site in _thread.watching:
        site.needs_grad("autograd inside its forward")
    return wrapped(*args, **kwargs)


class _RegisterHook(MethodPatch):
    """``Tensor.register_hook`` (a `MethodPatch`: ``torch.Tensor.register_hook`` stays one object)."""

    @staticmethod
    def calling(wrapped: Any, name: str) -> Any:
        def register_hook(*args: Any, **kwargs: Any) -> Any:
            for site in _thread.watching:
                site.needs_grad("autograd inside its forward")
            return wrapped(*args, **kwargs)

        return register_hook


#: The listener below runs on every backward only while it has something to do: during a watched forward (a backward
#: inside it), and for the next two backwards after a forward we ran under no_grad (the first takes note of it for its
#: error message, the second clears that note). A training loop pays nothing for it otherwise.
_WATCH = "ST003:backwards"
_listening = False


def _listen_to_backwards() -> None:
    global _listening
    if not _listening:
        _listening = True
        _backward.listen(_WATCH, before=_before_backward)


def _stop_listening() -> None:
    global _listening
    if _listening:
        _listening = False
        _backward.unlisten(_WATCH)


def _before_backward(tensors: Any) -> None:
    thread = _thread
    if thread.watching:
        for site in thread.watching:
            site.needs_grad("a backward inside its forward")
    site = thread.nograd
    if site is not None:
        thread.nograd = None
        # Still alive at the backward (``out = model(x)``, then ``loss = f(out)``): it most likely starts there.
        thread.suspect = (site, any(r() is not None for r in site.outputs))
        return
    thread.suspect = None
    if not thread.watching:
        _stop_listening()


def _backward_error(error: RuntimeError) -> BaseException | None:
    """torch's "does not require grad" error after a forward that we ran under no_grad, in this thread, since the last
    backward. When that forward's output is still alive (``out = model(x)``; ``loss = f(out)``) the backward starts
    from it: a `SafetorchError` says why there is no graph. Otherwise torch's error keeps its type and message, and
    gets a note naming that forward as a possible cause."""
    suspect, _thread.suspect = _thread.suspect, None
    if suspect is None or "does not require grad" not in str(error):
        return None
    site, starts_there = suspect
    why = (f"safetorch ran the eval-mode forward of {site.name} ({site.kind}) at {site.filename}:{site.lineno} under "
           f"torch.no_grad() (nothing had used the graph of the first forward there), so its output carries no graph. "
           f"{_ways_out(site)}")
    if starts_there:
        return SafetorchError(f"{CODE} backward() failed: {error}. {why}", code=CODE)
    if hasattr(error, "add_note"):
        error.add_note(f"{CODE} note: if this loss comes from that forward: {why}")
    return None


def _install_shared(registry: Registry) -> None:
    registry.replace(torch.nn.Module, "train", _train, GROUP)
    registry.replace(torch.nn.Module, "__getstate__", _getstate, GROUP)
    registry.wrap(torch.nn.Module, "_replicate_for_data_parallel", _replicate, GROUP)
    for cls in (grad_mode.enable_grad, grad_mode.set_grad_enabled, grad_mode.inference_mode):
        registry.wrap(cls, "__enter__", _enter_explicit, GROUP)
        registry.wrap(cls, "__exit__", _exit_explicit, GROUP)
    registry.wrap(torch.autograd, "grad", _autograd_in_forward, GROUP)
    registry.method(torch.Tensor, "register_hook", _RegisterHook, GROUP)
    _backward.listen(CODE, on_error=_backward_error)


def enable(code: str, registry: Registry = registry) -> None:
    if not _codes:
        _install_shared(registry)
    _codes.add(code)


def disable(code: str) -> None:
    """Switch one of ST003/ST008 off; with both off, take every patch and guard away and forget every site."""
    _codes.discard(code)
    if _codes:
        return
    _stop_listening()
    _backward.unlisten(CODE)
    registry.restore(GROUP)
    for ref, _ in list(_sites.guarded.values()):
        module = ref()
        if module is not None:
            _unguard(module)
    _sites.guarded.clear()
    _sites.clear()


def reset() -> None:
    """Forget every call site (tests, and programs that want ST003 to watch again)."""
    _sites.clear()


def install(registry: Registry) -> None:
    enable(CODE, registry)


def uninstall() -> None:
    disable(CODE)
