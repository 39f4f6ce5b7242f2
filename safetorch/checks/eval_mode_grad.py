"""ST003 and ST008: an eval-mode model called at top level with autograd on. Observe first, then act.

People call ``model.eval()`` and believe it disables gradients; it only switches dropout and BatchNorm, and a
validation loop without ``torch.no_grad()`` keeps every activation for a backward that never comes (ST003). The
opposite mistake is as common and as silent: a model that is still in eval mode while it trains, because a library
returned it that way (``from_pretrained``) or ``model.train()`` was forgotten after a validation pass (ST008). ST008
names what eval mode changes in that model (`safetorch._modes`), and stays silent for a model whose numbers it does
not change (no dropout, no running statistics, nothing of its own that reads ``training``).

What happens, per call site (the user's line, the call instruction on it, and the module), for top-level calls only
(a module called from inside another module's forward, through ``net(x)`` or a direct ``net.forward(x)``, is never
a site, and this is known before any site is looked up):
1. The first eval-mode forward at a site runs **exactly as written**, with grad, and is watched: does its output's
   graph reach a leaf that is not a parameter of this module (an input at any depth, another model's parameters, a
   global tensor)? Does the forward itself call ``torch.autograd.grad``/``backward`` or register a tensor hook (torch's
   own hooks, FSDP2's, do not count)? Does a backward later go through any node of its graph? An output with no graph
   at all (a forward under its own no_grad, or returning numbers) leaves the site alone for good.
2. Every later forward there runs under no_grad with its output grafted onto one node that saves nothing
   (`_eval_act`): the program's numbers and structure, each tensor with a ``grad_fn``, keeping what no_grad keeps; a
   backward that reaches one recomputes it from its inputs (or, if they are gone, raises an explained
   `SafetorchError`), and the site runs as written from then on. While the watched graph lives (a rollout buffer,
   outputs kept for a later loss) nothing is decided and the newest forwards hold their inputs (the newest, and the
   older ones while their inputs total at most `_eval_act.HELD_BYTES`); once
   decided, the newest forward holds its inputs (a backward right after it, a diagnostic every few batches). The
   site is an evaluation (ST003) when the evidence arrives: the watched graph died unused (a weak reference's
   callback on the hook object its nodes hold; reported at the next forward at that line, which raises in strict
   mode, or at the next eval-mode forward, ``train()`` or exit), or it is still alive, never used, at exit (a
   collecting ``preds = [model(x) for x in loader]``). The finding names the forward's line.
3. ST008: when a backward reached a forward of such a module, and an optimizer step updates its parameters in eval
   mode, it is reported at the forward's line if the eval mode is a mistake: a library's ``eval()`` (a loader), or the
   program's own ``eval()`` followed by an evaluation. A loader's model first called inside a new training parent
   (``get_peft_model(from_pretrained(...))``) is reported at the line that called the outermost module.

Design rules:
- Nothing global on the forward path: the module the program puts in eval mode (its ``eval()`` called directly, not
  a child that a parent's ``train()`` recursed into) gets a guard in its own ``__dict__`` under ``_call_impl``, which
  ``Module._wrapped_call_impl`` looks up on the instance. Calling through the guard keeps torch's hook-free fast path
  and changes no global state (grad mode is never switched). A guarded module called from inside another module's
  forward (frozen BatchNorm in a training net) loses its guard at that first call: a training parent decides for its
  children. ``train()``, or ``training`` set back to True by assignment, drops the guard.
- The guard belongs to its module and never leaves it: found in a copy of the module's ``__dict__`` (a clone), it
  runs the clone's own forward; ``Module.__reduce_ex__`` reduces without it (pickle, ``torch.save``, ``copy.copy``,
  ``fx.GraphModule``'s own ``__reduce__``), as do ``GraphModule.__reduce_package__`` and ``Module.compile``; a model
  saved with safetorch holds the bytes of the same model saved without it. ``copy.deepcopy`` gives the copy its own
  guard; DataParallel replicas are made without it.
- An evaluation pays for its first forward only: under no_grad or inference_mode the guard steps out of its
  module's ``__dict__`` at that forward and is put back as soon as grad mode can come back (`_step_aside`).
- Costs are O(1) in the number of eval-mode modules: optimizer steps touch no module, nor does a grad-mode switch
  unless a guard stands aside; ST008's step hook exists only while a site waits for its step, and goes at a backward
  (never from inside torch's iteration over its step hooks).
- Explicit grad mode (``with torch.enable_grad()``, ``with torch.set_grad_enabled(True)``, ``inference_mode(False)``,
  each also as a decorator) switches the check off for its scope only, per thread, as torch's grad mode is. The
  function form ``torch.set_grad_enabled(True)`` is not a scope: Lightning's fit loop calls it, and it leaves nothing.
- Tracing (``torch.jit.trace``, ``torch.fx``), ``torch.compile``/export, ``torch.func`` transforms, dispatch modes
  (``FlopCounterMode``) and profilers pass straight through: they neither watch nor decide.
- All state lives in one `_Sites` object that `reset` and `uninstall` clear; a per-line
  ``# safetorch: ignore[ST003]``, or a warnings filter that names ST003, leaves that site alone.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from types import CodeType, FrameType
from typing import Any

import torch
from torch.autograd import grad_mode
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _backward, _callsite, _config, _visible
from .._callsite import callee, getline
from .._compat import compile_flags, dynamo_compiling, is_compiling
from .._exceptions import SafetorchWarning
from .._hooks import untallied
from .._modes import eval_effects, joined
from .._patch import MethodPatch, Registry, registry
from .._report import (
    before_summary,
    internal_error,
    is_internal,
    is_library,
    report_at,
    rule_off,
    suppressed,
    user_frame,
)
from .._rule import Rule
from .._tracebacks import hide_own_frames
from . import _eval_act

CODE = "ST003"


class EvalModeGradWarning(SafetorchWarning):
    """ST003: an eval-mode forward ran with autograd on, for nothing."""

    code = "ST003"


RULE = Rule("ST003", "eval-mode-grad", EvalModeGradWarning,
            "forward of an eval-mode model with autograd on, for nothing")
TRAINING_CODE = "ST008"
GROUP = "eval-mode"  # the patches ST003 and ST008 share: in place while either is installed

_call_impl_code = torch.nn.Module._call_impl.__code__
_wrapped_call_impl_code = torch.nn.Module._wrapped_call_impl.__code__
_module_call_impl = torch.nn.Module._call_impl
_is_compiling = is_compiling
_dynamo_compiling = dynamo_compiling
_flags = compile_flags
_is_grad_enabled = torch.is_grad_enabled
_tracing_state = torch._C._get_tracing_state
_functorch = getattr(torch._C, "_functorch", None)
_peek_interpreter = getattr(_functorch, "peek_interpreter_stack", None) or (lambda: None)
_fx_trace = getattr(torch.fx, "_symbolic_trace", None)  # its flag is read: is_fx_tracing() warns on each call
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None) or (lambda: 0)
_profiling = getattr(torch._C._autograd, "_profiler_enabled", None) or (lambda: False)
_getrefcount = sys.getrefcount

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

    def __init__(self) -> None:
        self.watching = []


_thread = _Thread()
_codes: set[str] = set()  # which of ST003 / ST008 / ST019 are installed (the shared patches stand for any)
_eval_codes: set[str] = set()  # which of ST003 / ST008 are installed (guards for eval-mode modules)


# --- sites -----------------------------------------------------------------------------------------------------


class _Site:
    """One call site of one module: its decision and what the watched first forward showed."""

    __slots__ = ("acts", "at", "backward", "due", "filename", "globals", "graph", "held", "kind", "lineno", "module",
                 "name", "needs", "opaque", "origin", "state", "st008", "watched", "__weakref__")

    WATCHING, TRAIN, EVAL, FROZEN = "watching", "train", "eval", "frozen"

    def __init__(self, module: torch.nn.Module, frame: FrameType) -> None:
        self.module = weakref.ref(module)
        self.filename = frame.f_code.co_filename
        self.lineno = frame.f_lineno
        self.globals = frame.f_globals
        self.at = (frame.f_code, frame.f_lasti)  # the forward's call: the finding's expression
        self.name = callee(frame) or "model"
        self.kind = type(module).__name__
        self.state = _Site.WATCHING
        self.watched = False  # its first forward ran (watched); the next one decides
        self.needs: str | None = None  # why the site needs gradients, once known
        self.backward = False  # a backward reached the watched forward's output or parameters
        #: Lives as long as the watched forward's graph (the hook on its nodes): dead means the graph died.
        self.graph: weakref.ref[Any] | None = None
        self.acts = True  # ST003 is on at this line: the site may become an evaluation
        self.st008 = 0  # optimizer steps seen while waiting for ST008
        self.origin: Origin | None = None  # who put the module in eval mode, kept for ST008's message
        self.due = False  # training the module in eval mode is known to be ST008's finding
        self.opaque = False  # its output holds tensors the act cannot graft: as written
        #: While nothing is decided: the newest forwards that hold their inputs, for a backward that may still come.
        self.held = _eval_act.Held(_eval_act.HELD)

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
            _due.clear()
            self.pending.clear()
            if self.step_hook is not None:
                self.step_hook.remove()
                self.step_hook = None
        _backward.unlisten(_UNHOOK)


_sites = _Sites()


# --- the guard -------------------------------------------------------------------------------------------------


class _Guard:
    """Stands in the module's ``__dict__`` as ``_call_impl``; `Module._wrapped_call_impl` calls it with the forward's
    arguments. Holds its module weakly, so that an eval-mode model is freed as soon as the program drops it."""

    __slots__ = ("evaluated", "module", "__weakref__")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)
        #: Since its eval(), the module ran an evaluation: a forward under no_grad/inference_mode, or at a site ST003
        #: decided. The evidence for ST008 that a user's own eval() was meant for evaluation, not for a frozen net.
        self.evaluated = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        module = self.module()
        # A call first, not torch.compiler's flag alone: dynamo answers the call as a constant, while it would guard
        # a flag read, True while it traces and False when the graph runs (a recompile at every call). The flag is
        # read only outside dynamo (torch.export's tracing without it). See `_compat.dynamo_compiling`.
        if _dynamo_compiling() or _flags._is_compiling_flag:
            return _module_call_impl(module, *args, **kwargs)  # dynamo traces this: sys._getframe would break it
        try:
            # Held by more than the module's __dict__ and this call: perhaps by a copy of that __dict__ (a clone). Only
            # then is the caller's frame read (the refcount costs a C call; the frame's locals, a dict).
            if _getrefcount(self) > _GUARD_REFS:
                caller = sys._getframe(1)
                owner = caller.f_locals.get("self") if caller.f_code is _wrapped_call_impl_code else module
                if owner is not module and isinstance(owner, torch.nn.Module):
                    # Found in a copy of another module's __dict__ (a clone made by copying it): the clone runs its own
                    # forward, unguarded; the guard belongs to the module it was made for.
                    if owner.__dict__.get("_call_impl") is self:
                        del owner.__dict__["_call_impl"]
                    return _module_call_impl(owner, *args, **kwargs)
            if module is None:
                raise RuntimeError("safetorch: a module guard outlived its module")
            if module.training or not _eval_codes:
                followed = _followed.get(id(module))
                if followed is not None and followed[0]() is module:
                    if module.training:
                        # ST019's: a trained module's forward in training mode. One that follows a backward (every
                        # training step's) only notes the count; one with no backward since the module's last forward
                        # goes to ST019.
                        count = _backward.count
                        if followed[2] != count:
                            followed[2] = count
                            return _module_call_impl(module, *args, **kwargs) if kwargs else \
                                _module_call_impl(module, *args)
                        return followed[1](module, args, kwargs)
                    return _module_call_impl(module, *args, **kwargs)  # eval mode, with ST003 and ST008 off
                _unguard(module, self)
                return _module_call_impl(module, *args, **kwargs)
            if not _is_grad_enabled():  # an evaluation: the guard stands aside until grad mode can come back
                self.evaluated = True
                _step_aside(module, self)
                # An empty ``**kwargs`` still makes the call copy a dict (240 instructions a forward, counted).
                return _module_call_impl(module, *args, **kwargs) if kwargs else _module_call_impl(module, *args)
            if _thread.explicit:
                return _module_call_impl(module, *args, **kwargs)
            return _eval_forward(module, self, args, kwargs)
        except BaseException as exc:  # the program's error in its forward: its traceback shows no frame of ours
            hide_own_frames(exc)
            raise

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


def _calibrate() -> int:
    """How many references a guard has inside its own call when only its module's ``__dict__`` holds it (the
    interpreter's own references differ between Python versions): one more means a copy of that ``__dict__``."""
    seen: list[int] = []

    class _Probe(_Guard):
        __slots__ = ()

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(_getrefcount(self))

    probe = torch.nn.Module()
    probe.__dict__["_call_impl"] = _Probe(probe)
    probe()
    return seen[0] if seen else 0


_GUARD_REFS = _calibrate()


def _guard_of(module: torch.nn.Module) -> _Guard | None:
    if _aside:
        _rearm_guards()
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
    followed = _followed.get(id(module))
    if followed is not None and followed[0]() is module and module.training:
        pass  # ST019 follows it in training mode: its guard stays (it is no longer ST003's)
    elif isinstance(d.get("_call_impl"), _Guard) and (guard is None or d["_call_impl"] is guard):
        del d["_call_impl"]
    _sites.guarded.pop(id(module), None)


# --- standing aside during an evaluation ---------------------------------------------------------------------
#
# Inside a no_grad or inference_mode scope an eval-mode module's forward is an evaluation, and the guard has nothing
# to do but note it (`_Guard.evaluated`). So at the first such forward the guard leaves its module's ``__dict__`` and
# the validation loop's later forwards run torch's own ``_call_impl``. It comes back as soon as grad mode can: when
# ``torch.set_grad_enabled`` is made with True (which a no_grad scope's exit does, and the function form, and the
# scope), at an inference_mode scope's exit, at any ``train()``/``eval()``, and before anything reads a module's
# guard (`_guard_of`). While a guard stands aside, ``set_grad_enabled.__init__`` is ours, a plain function that puts the
# guards back and then itself; the rest of the time it is torch's, and an optimizer step (which calls
# ``torch.set_grad_enabled`` twice) pays nothing.

#: The guards standing aside: (a weak reference to the module, its guard).
_aside: list[tuple[weakref.ref[torch.nn.Module], _Guard]] = []
_set_grad_enabled = grad_mode.set_grad_enabled
_torch_init = _set_grad_enabled.__init__


def _init(self: Any, mode: bool) -> None:
    """``set_grad_enabled.__init__`` while a guard stands aside."""
    __tracebackhide__ = True  # noqa: F841
    if mode:
        try:
            _rearm()
        except Exception as exc:
            internal_error(CODE, exc)
    try:
        _torch_init(self, mode)
    except BaseException as exc:  # torch's own error (a mode that is not a bool): no frame of ours in it
        hide_own_frames(exc)
        raise


functools.update_wrapper(_init, _torch_init)


def _step_aside(module: torch.nn.Module, guard: _Guard) -> None:
    d = module.__dict__
    if d.get("_call_impl") is not guard:
        return
    del d["_call_impl"]
    _aside.append((weakref.ref(module), guard))
    if _set_grad_enabled.__dict__.get("__init__") is not _init:
        _set_grad_enabled.__init__ = _init  # type: ignore[method-assign]


def _rearm() -> None:
    """Every guard back in its module, and torch's ``set_grad_enabled.__init__`` back in its class."""
    if _set_grad_enabled.__dict__.get("__init__") is _init:
        _set_grad_enabled.__init__ = _torch_init  # type: ignore[method-assign]
    _rearm_guards()


def _rearm_guards() -> None:
    while _aside:
        try:
            ref, guard = _aside.pop()
        except IndexError:  # another thread took the last one
            return
        module = ref()
        if module is None or guard.module() is not module:
            continue
        key = id(module)
        guarded, followed = _sites.guarded.get(key), _followed.get(key)
        if (guarded is not None and guarded[0]() is module) or (followed is not None and followed[0]() is module):
            module.__dict__.setdefault("_call_impl", guard)


#: The modules ST019 follows in training mode (trained by an optimizer, with BatchNorm or dropout): id -> (a weak
#: reference to the module, what its guard calls for a training-mode forward instead of ``_call_impl``). Their guard
#: is the same object ST003 uses in eval mode, so that both rules share one ``_call_impl`` slot: ``train()`` keeps it.
#: The entry: [weak reference, handler, `_backward.count` at the module's last training-mode forward].
ForwardHandler = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], Any]
_followed: dict[int, list[Any]] = {}


def follow(module: torch.nn.Module, on_forward: ForwardHandler) -> None:
    """Hand ``module``'s training-mode forwards that no backward preceded since its last one to
    ``on_forward(module, args, kwargs)`` (which calls ``Module._call_impl`` itself), through the guard in its
    ``__dict__``, until `unfollow_all` or the module is freed."""
    key, followed = id(module), _followed  # bound now: the callback may run at interpreter exit

    def gone(ref: weakref.ref[torch.nn.Module]) -> None:
        entry = followed.get(key)
        if entry is not None and entry[0] is ref:
            del followed[key]

    _followed[key] = [weakref.ref(module, gone), on_forward, -1]
    guard = _guard_of(module)
    if guard is None or guard.module() is not module:
        module.__dict__["_call_impl"] = _Guard(module)


def following(module: torch.nn.Module) -> bool:
    """Whether ``module`` is followed and still holds its guard."""
    entry = _followed.get(id(module))
    guard = _guard_of(module)
    return entry is not None and entry[0]() is module and guard is not None and guard.module() is module


def unfollow_all() -> None:
    """Stop following every module; those in training mode lose their guard (eval-mode ones keep ST003's)."""
    entries = list(_followed.values())
    _followed.clear()
    for ref, *_ in entries:
        module = ref()
        if module is not None and module.training:
            _unguard(module)


def _nested(frame: FrameType | None) -> bool:
    """True when another module's ``_call_impl`` runs above this call: a parent's forward called this module."""
    while frame is not None:
        if frame.f_code is _call_impl_code:
            return True
        frame = frame.f_back
    return False


def _passthrough() -> bool:
    """Forwards that are not a program's own calls, and neither watch nor decide a site: tracing (``torch.jit.trace``,
    ``torch.fx.symbolic_trace``), compiling and export, ``torch.func`` transforms, and forwards under a dispatch mode
    (``FlopCounterMode``, fake tensors) or a profiler."""
    return bool(_is_compiling() or _tracing_state() or _peek_interpreter() is not None
                or getattr(_fx_trace, "_is_fx_tracing_flag", False) or _dispatch_modes() or _profiling())


def _first_argument(frame: FrameType) -> Any:
    code = frame.f_code
    return _visible.frame_locals(frame).get(code.co_varnames[0]) if code.co_argcount > 0 else None


def _in_forward(caller: FrameType) -> bool:
    """True when the program's line is in a module's ``forward`` (called directly, ``net.forward(x)``: no
    ``_call_impl`` above it): a parent's forward calls this module, as inside ``net(x)``."""
    return caller.f_code.co_name == "forward" and isinstance(_first_argument(caller), torch.nn.Module)


def _eval_forward(module: torch.nn.Module, guard: _Guard, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An eval-mode forward with grad on and not asked for: watch it, run it keeping what no_grad keeps, or leave it
    alone."""
    __tracebackhide__ = True  # noqa: F841
    site = None
    try:
        if not _passthrough():
            site = _site_for(module, guard, sys._getframe(2))
    except Exception as exc:
        internal_error(CODE, exc)
    if _due and not _config.current.strict:
        _flush(site)  # this line's own site is decided below, at this forward
    if site is None or site.state is _Site.TRAIN or site.state is _Site.FROZEN:
        return _module_call_impl(module, *args, **kwargs)
    if site.state is _Site.WATCHING:
        if not site.watched:
            return _watched(module, site, args, kwargs)
        _decide(site, guard)
        if site.state is _Site.TRAIN:
            return _module_call_impl(module, *args, **kwargs)
    if rule_off(CODE, site.filename, site.lineno, site.globals):
        return _module_call_impl(module, *args, **kwargs)  # a warnings filter switched ST003 off here: as written
    if site.state is _Site.EVAL:
        # Every forward counts in the summary, and a warning first hit under an ignore filter is shown later.
        report_at(CODE, site.filename, site.lineno, site.globals, lambda: _message(site), site.at)  # strict: raises
    return _act(module, site, args, kwargs)


def _act(module: torch.nn.Module, site: _Site, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward keeping what no_grad keeps (`_eval_act`). An input that requires grad (an adversarial example)
    runs as written; so does a site whose output holds tensors in an object the act cannot change."""
    __tracebackhide__ = True  # noqa: F841
    try:
        if not site.opaque and _sharded(module):
            site.opaque = True
        direct = site.opaque or _eval_act.requires_grad(args, kwargs)
    except Exception as exc:
        internal_error(CODE, exc)
        direct = True
    if direct:
        return _module_call_impl(module, *args, **kwargs)
    held = site.held
    try:
        return _eval_act.run(module, args, kwargs, functools.partial(_reached_again, weakref.ref(site)),
                             functools.partial(_cannot, site.name, site.kind, site.filename, site.lineno), held)
    except _eval_act.Opaque:
        site.opaque = True  # the forward ran under no_grad: run it again as written, and from now on
        return _module_call_impl(module, *args, **kwargs)
    finally:
        if _aside:  # the act gave grad mode back by itself: a guard that stood aside inside its forward comes back
            _rearm()


def _sharded(module: torch.nn.Module) -> bool:
    """An FSDP module: its forward under no_grad skips the hooks that reduce its gradients, so a backward that
    recomputed it would train each rank on its own gradients. It runs as written (reported all the same)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return False
    kinds = tuple(k for k in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None))
                  if isinstance(k, type))
    return bool(kinds) and isinstance(module, kinds)


def _reached_again(ref: weakref.ref[_Site]) -> None:
    """A backward reached a forward the act ran: the site trains, and runs as written from then on."""
    site = ref()
    if site is not None:
        try:
            _backward_reached(site)
        except Exception as exc:
            internal_error(CODE, exc)


def _cannot(name: str, kind: str, filename: str, lineno: int, why: str) -> str:
    return (f"{CODE} this backward reaches the output of {name}({kind}) at {filename}:{lineno}, which safetorch ran "
            f"without keeping its graph: {name} is in eval mode with autograd on, and the graph of the first forward "
            f"at that line died unused, so safetorch took the line for an evaluation and kept only what "
            f"torch.no_grad() keeps. It cannot recompute that forward now: {why}. Write: {name}.train() before "
            f"training through that line (or `with torch.enable_grad():` around the forward, or "
            f"`# safetorch: ignore[ST003]` on it); if it is an evaluation, `with torch.no_grad():` around it and no "
            f"backward through its outputs")


def _site_for(module: torch.nn.Module, guard: _Guard, frame: FrameType) -> _Site | None:
    caller = user_frame(frame)
    while caller is not None and caller.f_code.co_name == "__call__" and _first_argument(caller) is module:
        caller = user_frame(caller.f_back)  # the class's own __call__ (``super().__call__(x)``): its caller's line
    if caller is None:
        return None
    # Top-level or not is known before any site is looked up: a line reached inside a parent's forward (through
    # ``net(x)``, or a direct ``net.forward(x)``) is never a site, whatever it was reached for before.
    if _nested(frame) or _in_forward(caller):
        _child_call(module, guard, frame)  # a child of a running forward: its parent decides
        return None
    caller = _evaluation_caller(module, caller)
    site = _sites.site(module, caller)
    if site is not None:
        return site
    site = _sites.add(module, caller)
    site.acts = CODE in _codes and not suppressed(CODE, site.filename, site.lineno, site.globals)
    if not any(p.requires_grad for p in module.parameters()):
        site.state = _Site.FROZEN  # nothing to record, nothing to save
    return site


_LOOPS = frozenset({"FOR_ITER", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE"})


def _evaluation_caller(module: torch.nn.Module, caller: FrameType) -> FrameType:
    """The line to report: a helper without a loop that only calls the model (``infer(x)``, shared by the training
    and the validation step, as skorch's was before #219), called by the function (not a script's top level) that put
    the module in eval mode, is reported at that function's call of the helper, where ``torch.no_grad()`` goes."""
    entry = _sites.guarded.get(id(module))
    code = entry[1][0] if entry is not None and entry[1] is not None else None
    if code is None or code.co_name == "<module>":
        return caller  # a script's top level: the helper's line is where `safetorch fix` can tell what it may do
    outer = user_frame(caller.f_back) if caller.f_code is not code else None
    if outer is None or outer.f_code is not code:
        return caller
    return caller if any(i.opname in _LOOPS for i in _callsite.instructions(caller.f_code)) else outer


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
        elif not isinstance(v, type) and not callable(v):
            stack.extend(_visible.own_values(v))  # without building its __dict__: the object may live all run
    return found


def _inspect(module: torch.nn.Module, site: _Site, output: Any) -> None:
    """Walk the watched output's graph. A leaf that is not our parameter means the graph is needed; every other node
    gets a pre-hook, so that a backward through any part of this forward's graph (its output, or activations that
    a hook captured) is seen. The hooks live as long as that graph; parameters' accumulators, shared with every other
    graph of the module, get none."""
    params = {id(p) for p in module.parameters()}
    reached = _Reached(site)
    stack = list({t.grad_fn for t in _tensors(output, [_INPUT_BUDGET]) if t.grad_fn is not None})
    if not stack:
        # No graph left the forward (it ran under no_grad itself, or returned detached values or numbers): it keeps
        # nothing for a backward, and there is nothing to do at this site.
        site.state = _Site.FROZEN
        return
    site.graph = weakref.ref(reached, functools.partial(_graph_died, weakref.ref(site), _due))
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
        untallied(node.register_prehook, reached)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)


class _Reached:
    """A pre-hook on the nodes of a watched forward's graph: a backward went through it. Lives with that graph."""

    __slots__ = ("site", "__weakref__")

    def __init__(self, site: _Site) -> None:
        self.site = weakref.ref(site)

    def __call__(self, grad_outputs: Any) -> None:
        site = self.site()
        if site is not None and _eval_codes and not site.backward:
            try:
                _backward_reached(site)
            except Exception as exc:
                internal_error(CODE, exc)
        return None


def _backward_reached(site: _Site) -> None:
    """A backward went through a forward of this site (its watched graph, or a forward the act ran, recomputed): the
    site trains, and its later forwards run as written."""
    site.needs_grad("a backward")
    if site.state is _Site.EVAL or site.state is _Site.WATCHING and site.watched:
        site.state = _Site.TRAIN
    if not site.backward:
        site.backward = True
        module = site.module()
        if TRAINING_CODE in _codes and module is not None:
            # Whether it is due is asked again at each step it waits for: the evidence may come later (an evaluation).
            _arm_st008(site, _st008_evidence(module)[1])


def _st008_evidence(module: torch.nn.Module) -> tuple[bool, Origin | None]:
    """(whether training this eval-mode module is ST008's finding, who put it in eval mode). It is when a library
    called its ``eval()`` (a loader such as ``from_pretrained``), or when the program's own ``eval()`` was followed
    by an evaluation (forwards under no_grad, or a site ST003 decided): the forgotten ``train()`` after validation.
    The program's ``eval()`` followed straight by training is a choice (a backbone frozen on purpose): silent."""
    entry = _sites.guarded.get(id(module))
    origin = entry[1] if entry is not None else None
    guard = _guard_of(module)
    if guard is not None and not guard.evaluated and any(
            s.module() is module and s.state is _Site.WATCHING and s.watched and s.needs is None
            and s.graph is not None and s.graph() is None for s in list(_sites.sites.values())):
        guard.evaluated = True  # a watched forward whose graph died unused: an evaluation, not yet decided
    # A library's eval() inside a module's __init__ freezes that library's own layers: not a loader's.
    by_library = origin is not None and bool(origin[2]) and origin[0].co_name != "__init__" and _library(origin[0])
    return by_library or (guard is not None and guard.evaluated), origin


def _child_call(module: torch.nn.Module, guard: _Guard, frame: FrameType) -> None:
    """The first call of a guarded module from inside another module's forward: the training parent decides for it,
    and the guard goes. When its eval mode is ST008's finding (`_st008_evidence`: a loader's ``eval()`` under a new
    wrapper, ``get_peft_model(from_pretrained(...))``), an optimizer step of its parameters is reported at the
    program's line that called the outermost module."""
    try:
        if TRAINING_CODE in _codes and any(p.requires_grad for p in module.parameters()):
            due, origin = _st008_evidence(module)
            top = _outermost_caller(frame) if due else None
            if top is not None:
                site = _Site(module, top)
                site.state, site.backward, site.due = _Site.TRAIN, True, True  # its guard goes: decided now
                _arm_st008(site, origin)
    except Exception as exc:
        internal_error(TRAINING_CODE, exc)
    _unguard(module, guard)


def _outermost_caller(frame: FrameType | None) -> FrameType | None:
    """The program's frame that called the outermost module whose forward runs (``model(x)`` in the training loop)."""
    outer = None
    while frame is not None:
        if frame.f_code is _call_impl_code:
            outer = frame
        frame = frame.f_back
    return user_frame(outer.f_back) if outer is not None else None


def _decide(site: _Site, guard: _Guard) -> None:
    """A later forward at a watched site: it needs gradients (something used the watched graph), or it is an
    evaluation (the watched graph died unused: ST003 from now on), or it is too early to tell (the watched graph is
    still alive: a rollout buffer, outputs kept for a later loss) and this forward runs as the act (`_act`)."""
    if site.needs is not None or not site.acts:
        # With ST008 alone, or on a line that says `# safetorch: ignore[ST003]`, observe and never change anything.
        site.state = _Site.TRAIN
        return
    if site.graph is not None and site.graph() is not None:
        return
    _evaluation(site, guard)


def _evaluation(site: _Site, guard: _Guard | None) -> None:
    """The evidence arrived: the site is an evaluation, and its forwards let go of the inputs they held."""
    site.state = _Site.EVAL
    if guard is not None:
        guard.evaluated = True
    _eval_act.release(site.held)
    site.held = _eval_act.Held(1)  # the newest forward's inputs: a backward right after it recomputes it


#: Sites whose watched graph died unused, told by the weak reference's callback (which only appends: it runs wherever
#: the last node was freed, inside torch or the reporter). Decided and reported at the next eval-mode forward,
#: ``train()`` or exit; in strict mode at the next forward at that line (which raises there) or exit.
_due: list[weakref.ref[_Site]] = []


def _graph_died(site: weakref.ref[_Site], due: list[weakref.ref[_Site]], _: Any) -> None:
    due.append(site)


def _undecided(site: _Site) -> bool:
    return site.state is _Site.WATCHING and site.watched and site.needs is None and site.acts and not site.backward


def _flush(current: _Site | None = None) -> None:
    """Decide and report the sites whose watched graph died unused since (see `_due`), but ``current``, the site of the
    forward running now, which `_decide` takes at its own line."""
    __tracebackhide__ = True  # noqa: F841
    while _due:
        try:
            site = _due.pop()()
            if site is None or site is current or not _undecided(site):
                continue
            module = site.module()
            if module is None or module.training:
                continue
            _evaluation(site, _guard_of(module))
        except Exception as exc:  # another thread emptied it first, or a bug of ours
            internal_error(CODE, exc)
            continue
        # A warnings filter set to "error" raises the finding from here, as the program asked.
        report_at(CODE, site.filename, site.lineno, site.globals, lambda s=site: _message(s), site.at)


def _at_exit() -> None:
    """Before the exit summary: the graphs that died since, and the watched graphs still alive that no backward used
    (a collecting ``preds = [model(x) for x in loader]``): the program ended, nothing will."""
    _flush()
    for site in list(_sites.sites.values()):
        module = site.module()
        if _undecided(site) and site.graph is not None and module is not None and not module.training:
            _evaluation(site, _guard_of(module))
            report_at(CODE, site.filename, site.lineno, site.globals,
                      lambda s=site: _message(s, "saw its graph kept unused to the end of the program"), site.at)


def _message(site: _Site, evidence: str = "saw its graph die unused") -> str:
    return (f"{CODE} {site.name} ({site.kind}) is in eval mode with autograd on: eval() does not disable gradients, "
            f"so each forward here would keep every activation for a backward that never comes. safetorch watched "
            f"the first forward at this line, {evidence}, and runs the next ones keeping what torch.no_grad() keeps "
            f"(a backward that reaches one recomputes it while its inputs live). Write: `with torch.no_grad():` "
            f"around the evaluation (or {site.name}.train() if you train through this forward)")


# --- ST008: an optimizer trains a model that is in eval mode ---------------------------------------------------


def _arm_st008(site: _Site, origin: Origin | None) -> None:
    with _sites.lock:
        if site in _sites.pending:
            return
        site.st008, site.origin = 0, origin
        _sites.pending.append(site)
        if _sites.step_hook is None:
            _sites.step_hook = untallied(register_optimizer_step_pre_hook, _step_pre_hook)


_UNHOOK = "ST008:unhook"


def _unhook(tensors: Any) -> None:
    """A backward listener, once: take ST008's step hook away when no site waits for a step any more."""
    _backward.unlisten(_UNHOOK)  # the backward iterates over a tuple of listeners: leaving it now is safe
    with _sites.lock:
        if not _sites.pending and _sites.step_hook is not None:
            _sites.step_hook.remove()
            _sites.step_hook = None


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    __tracebackhide__ = True  # noqa: F841
    if not _sites.pending:
        return  # idle until the next backward takes it away
    try:
        held = {id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
        found, waiting = [], []
        for site in list(_sites.pending):
            module = site.module()
            site.st008 += 1
            if module is not None and not module.training and any(id(p) in held for p in module.parameters()) \
                    and (site.due or _st008_evidence(module)[0]):
                effects = eval_effects(module)
                if effects:  # none: eval mode changes nothing this model computes, and the site is done
                    found.append((site, effects))
            elif module is not None and site.st008 < _ST008_PATIENCE:
                waiting.append(site)
        with _sites.lock:
            _sites.pending = waiting
        if not waiting:
            # torch is iterating over its dict of global step pre-hooks right now: removing ours from it would make
            # the next hook's turn raise "OrderedDict mutated during iteration". It stays, idle, and goes at the
            # next backward, outside any optimizer step.
            _backward.listen(_UNHOOK, before=_unhook)
    except Exception as exc:
        internal_error(TRAINING_CODE, exc)
        return
    for site, effects in found:
        report_at(TRAINING_CODE, site.filename, site.lineno, site.globals,
                  lambda s=site, e=effects: _st008_message(s, e))


def _st008_message(site: _Site, effects: list[str]) -> str:
    """``effects``: what eval mode changes in this model (`safetorch._modes.eval_effects`), never empty."""
    origin = _describe(site.origin)
    return (f"{TRAINING_CODE} {site.name} ({site.kind}) is trained in eval mode: an optimizer updates its parameters, "
            f"but {joined(effects)}. It was put in eval mode by {origin}. "
            f"Write: {site.name}.train() before the training loop (or SAFETORCH_IGNORE=ST008 if you train it in eval "
            f"mode on purpose)")


# --- who put a module in eval mode ---------------------------------------------------------------------------

_library = is_library


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
    if not hasattr(code, "co_qualname") and len(_qualnames) < 256:
        _qualnames[code] = _qualname_of(frame)
    return code, frame.f_lasti, frame.f_globals.get("__name__", "?"), \
        (outer.f_code, outer.f_lasti) if outer is not None else None


#: Python 3.10 (no ``co_qualname``): the class-qualified names of the functions that called eval(), from their frames.
_qualnames: dict[CodeType, str] = {}


def _qualname_of(frame: FrameType) -> str:
    """``PreTrainedModel.from_pretrained`` for a method's frame, from the class that defines the running code (found
    along the MRO of its ``cls`` or ``self``); the function's name otherwise."""
    code = frame.f_code
    owner = frame.f_locals.get("cls", frame.f_locals.get("self")) if code.co_varnames[:1] in (("cls",), ("self",)) \
        else None
    if owner is not None:
        for klass in (owner if isinstance(owner, type) else type(owner)).__mro__:
            function = klass.__dict__.get(code.co_name)
            function = getattr(function, "__func__", function)
            if getattr(function, "__code__", None) is code:
                return f"{klass.__qualname__}.{code.co_name}"
    return code.co_name


def _line_at(code: CodeType, lasti: int) -> int:
    """The line of the instruction at ``lasti``, as ``frame.f_lineno`` gives it."""
    return next((line for start, end, line in code.co_lines() if start <= lasti < end and line is not None),
                code.co_firstlineno)


def _describe(origin: Origin | None) -> str:
    if origin is None:
        return "an eval() call"
    code, lasti, module, outer = origin
    filename, lineno = code.co_filename, _line_at(code, lasti)
    name = f"{module}.{getattr(code, 'co_qualname', None) or _qualnames.get(code, code.co_name)}()" if module else ""
    called = f"{outer[0].co_filename}:{_line_at(*outer)}" if outer is not None else ""
    where = f"{filename}:{lineno}"
    if module and _library(code):
        if outer is not None:  # the program's line first, the library's frame after it
            line = getline(outer[0].co_filename, _line_at(*outer)).strip()
            return f"`{line}` at {called}, in {name} at {where}" if line else f"{called}, in {name} at {where}"
        text = f"{name} at {where}"
    else:
        line = getline(filename, lineno).strip() or "eval()"
        text = f"`{line}` at {where}" + (f" in {name}" if name else "")
    return text + (f", called from {called}" if called else "")


# --- patches ---------------------------------------------------------------------------------------------------

#: The threads in which a ``train()`` call is running, by ident: a call made while one runs is a child's. A dict, not
#: a ``threading.local``: a child's call pays one lookup, where a thread-local's attributes cost three times as much.
#: The modules the program put in eval mode itself (its own ``eval()``, not a child's in torch's recursion), for the
#: checks that need to look only while one is (ST013: `watch_evaluation`). id -> weak reference.
_in_eval: dict[int, weakref.ref[torch.nn.Module]] = {}
_eval_watchers: dict[str, Callable[[bool], None]] = {}
_evaluating = [False]
#: A module of `_in_eval` was freed (its weak reference's callback only notes it: the next train()/eval() tells)
_eval_stale = [False]


def _eval_freed(_: Any) -> None:
    _eval_stale[0] = True


def watch_evaluation(code: str, callback: Callable[[bool], None] | None) -> None:
    """``callback(True)`` once a module the program put in eval mode is in it, ``callback(False)`` once none is
    (told at the program's ``train()``/``eval()`` calls; a freed module is noticed at the next one). Called at once
    with the present answer. None stops it."""
    if callback is None:
        _eval_watchers.pop(code, None)
        if not _eval_watchers:
            _in_eval.clear()
            _evaluating[0] = False
        return
    _eval_watchers[code] = callback
    callback(_evaluating[0])


def _evaluation_changed() -> None:
    """Tell the watchers when whether a module the program put in eval mode is still in it has changed."""
    for key, ref in list(_in_eval.items()):
        module = ref()
        if module is None or module.training:
            del _in_eval[key]
    _eval_stale[0] = False
    now = bool(_in_eval)
    if now != _evaluating[0]:
        _evaluating[0] = now
        for callback in list(_eval_watchers.values()):
            callback(now)


_training_threads: dict[int, bool] = {}
_get_ident = threading.get_ident


def _train(original: Any) -> Any:
    """``Module.train``, as a plain function (see `Registry.replace`): torch's ``train()`` calls it again for every
    child. The guard goes on the module whose eval() the program called, not on the children it recurses into: an
    ``eval()`` made while another runs in this thread is a child's, and returns at once. ``train()`` needs no such
    bookkeeping (its cost per call is torch's and one dict lookup): each module, children included, takes off a
    guard of its own (a frozen BatchNorm's, from an eval() of its own)."""

    def train(self: Any, mode: bool = True) -> Any:
        __tracebackhide__ = True  # noqa: F841
        try:
            if _aside:
                _rearm_guards()  # the module's own guard is back before torch's train() and ours look at it
            if mode is True:  # train(): nothing to tell apart, only a guard to take off (each child its own)
                raised = None
                if _due and not _config.current.strict:
                    try:
                        _flush()  # the evaluation ended: decided while its model is still in eval mode
                    except Warning as warning:  # a filter set to "error": raised once the module is in training mode
                        raised = warning
                result = original(self, mode)
                try:
                    if "_call_impl" in self.__dict__ and self.training:
                        _unguard(self)
                    if _in_eval and (_in_eval.pop(id(self), None) is not None or _eval_stale[0]):
                        _evaluation_changed()
                except Exception as exc:
                    internal_error(CODE, exc)
                if raised is not None:
                    raise raised
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
                else:
                    if _eval_codes and not _is_compiling() and not isinstance(self, torch.jit.ScriptModule):
                        _guard(self, _origin(sys._getframe(1)))
                    if _eval_watchers:
                        _in_eval[id(self)] = weakref.ref(self, _eval_freed)
                if _eval_watchers:
                    _evaluation_changed()
            except Exception as exc:
                internal_error(CODE, exc)
            return result
        except BaseException as exc:  # no frame of ours in the traceback of what passes through
            hide_own_frames(exc)
            raise

    return train


_deepcopy_code = __import__("copy").deepcopy.__code__


def _getstate(original: Any) -> Any:
    """``Module.__getstate__``: the guard stays out of pickles and shallow copies; ``copy.deepcopy`` gives the copy its
    own guard."""

    def __getstate__(self: Any) -> Any:
        state = original(self)
        if isinstance(state, dict) and isinstance(state.get("_call_impl"), _Guard):
            caller = sys._getframe(1)
            if caller.f_code is _REDUCE_EX_CODE:  # through our Module.__reduce_ex__: who called that
                caller = caller.f_back
            if caller is None or caller.f_code is not _deepcopy_code:
                del state["_call_impl"]
        return state

    return __getstate__


def _reduce_ex(original: Any) -> Any:
    """``Module.__reduce_ex__`` (which ``object`` gives every module): whatever reduces a module — pickle,
    ``torch.save``, ``copy.copy``, multiprocessing, a class's own ``__getstate__`` or ``__reduce__`` that copies the
    ``__dict__`` itself (``fx.GraphModule``) — does it without the guard, which is put back after; ``copy.deepcopy``
    keeps it (the copy gets a guard of its own)."""

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        if _aside:
            _rearm_guards()  # copy.deepcopy gives the copy a guard of its own, also during an evaluation
        d = self.__dict__
        guard = d.get("_call_impl")
        if not isinstance(guard, _Guard) or sys._getframe(1).f_code is _deepcopy_code:
            return original(self, protocol)
        del d["_call_impl"]
        try:
            return original(self, protocol)
        finally:
            d.setdefault("_call_impl", guard)

    return __reduce_ex__


_REDUCE_EX_CODE = _reduce_ex(None).__code__


def _without_guard(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A method that reads the module's own ``__dict__`` (``GraphModule.__reduce_package__``: torch.package;
    ``Module.compile``, which compiles ``self._call_impl``): it runs without the guard, which is put back after."""
    d = getattr(instance, "__dict__", {})
    guard = d.get("_call_impl")
    if not isinstance(guard, _Guard):
        return wrapped(*args, **kwargs)
    del d["_call_impl"]
    try:
        return wrapped(*args, **kwargs)
    finally:
        d.setdefault("_call_impl", guard)


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
    if _aside:
        _rearm()  # the end of an inference_mode scope gives grad mode back without set_grad_enabled
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
            # torch's own hooks in a forward (FSDP2's post-backward hooks on its outputs) need no graph of it; the
            # program's and its libraries' do (Grad-CAM, saliency).
            if _thread.watching and not is_internal(sys._getframe(1).f_code):
                for site in _thread.watching:
                    site.needs_grad("autograd inside its forward")
            return wrapped(*args, **kwargs)

        return register_hook


#: The listener below runs on every backward only while it has something to do: during a watched forward (a backward
#: inside it), until the next backward after it. A training loop pays nothing for it otherwise.
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
    watching = _thread.watching
    if watching:
        for site in watching:
            site.needs_grad("a backward inside its forward")
    else:
        _stop_listening()


def _install_shared(registry: Registry) -> None:
    registry.replace(torch.nn.Module, "train", _train, GROUP)
    registry.replace(torch.nn.Module, "__getstate__", _getstate, GROUP)
    registry.replace(torch.nn.Module, "__reduce_ex__", _reduce_ex, GROUP)
    if hasattr(torch.nn.Module, "compile"):
        registry.wrap(torch.nn.Module, "compile", _without_guard, GROUP)
    graph_module = getattr(getattr(torch, "fx", None), "GraphModule", None)
    if graph_module is not None and "__reduce_package__" in graph_module.__dict__:
        registry.wrap(graph_module, "__reduce_package__", _without_guard, GROUP)
    registry.wrap(torch.nn.Module, "_replicate_for_data_parallel", _replicate, GROUP)
    for cls in (grad_mode.enable_grad, grad_mode.set_grad_enabled, grad_mode.inference_mode):
        registry.wrap(cls, "__enter__", _enter_explicit, GROUP)
        registry.wrap(cls, "__exit__", _exit_explicit, GROUP)
    registry.wrap(torch.autograd, "grad", _autograd_in_forward, GROUP)
    registry.method(torch.Tensor, "register_hook", _RegisterHook, GROUP)


def enable(code: str, registry: Registry = registry) -> None:
    if not _codes:
        _install_shared(registry)
    _codes.add(code)
    if code in (CODE, TRAINING_CODE):
        _eval_codes.add(code)


def disable(code: str) -> None:
    """Switch one of ST003/ST008 off; with both off, take every patch and guard away and forget every site."""
    _codes.discard(code)
    _eval_codes.discard(code)
    _rearm()
    if _codes:
        if not _eval_codes:  # ST019 alone: eval-mode modules lose ST003's guards (followed ones keep theirs)
            for ref, _ in list(_sites.guarded.values()):
                module = ref()
                if module is not None and not following(module):
                    _unguard(module)
            _sites.clear()
        return
    _stop_listening()
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
    before_summary(CODE, _at_exit)


def uninstall() -> None:
    before_summary(CODE, None)
    disable(CODE)
