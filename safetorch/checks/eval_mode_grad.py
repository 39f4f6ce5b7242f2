"""ST003: the forward of an eval-mode model runs under ``torch.no_grad()`` when autograd would record for nothing.

People call ``model.eval()`` and believe it disables gradients; it only switches dropout and BatchNorm, and the
validation loop keeps every activation for a backward that never comes.

Semantics: a forward of module ``m`` runs under no_grad, reported once per call site, when all hold:
``m`` is in eval mode and called at top level (not from inside another module's forward: a training parent
decides for its children); grad mode is on and was not asked for explicitly (``torch.enable_grad()``,
``torch.set_grad_enabled(True)``); no tensor among the inputs requires grad (args, kwargs and one level of
lists/tuples/dicts); some parameter of ``m`` requires grad.

Design rules:
- No global module hooks (they switch off torch's fast path in ``Module.__call__`` for every module):
  ``Module.train`` is wrapped, and the module the program puts in eval mode gets one forward pre-hook and one
  always-called forward hook, removed again when it goes back to training. Modules never put in eval mode pay
  nothing; neither do the children a parent's ``train()`` recurses into (their forwards run inside the parent's).
- While grad mode is off in the program's only thread (a validation loop under ``torch.no_grad()``), no forward can
  need the check, so the hooks are parked: taken off the modules and put back when grad mode comes on again. The
  wrappers that track explicit grad mode see every such change made through torch's Python API, so a validation
  forward under no_grad takes torch's fast path and pays nothing. With more than one thread the hooks stay on (grad
  mode is per thread); ``inference_mode`` is followed too; a change made through ``torch._C`` directly is not seen,
  and leaves the hooks as they were.
- The hooks sit under fixed keys of the module's hook dictionaries, so deep copies and unpickled modules are handled
  as well as the original, and toggling eval/train never grows those dictionaries.
- The hook objects pickle as ``None.__init__``, a built-in no-op that accepts any arguments: a model saved with
  safetorch installed loads where safetorch is not. They deep-copy as themselves.
- Explicit grad mode is tracked per thread, as torch's grad mode is.
- When a backward then fails because it starts from a tensor computed under that no_grad, torch's bare
  "does not require grad" error becomes a `SafetorchError` that names the model and the ways out.
"""

from __future__ import annotations

import _thread
import sys
import threading
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.autograd import grad_mode

from .. import _backward
from .._callsite import callee
from .._exceptions import SafetorchError
from .._patch import Registry
from .._report import internal_error, is_internal, report, user_frame

CODE = "ST003"

_call_impl_code = torch.nn.Module._call_impl.__code__
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class _State(threading.local):
    explicit = False  # grad mode was switched on explicitly (enable_grad / set_grad_enabled(True))
    active: list[torch.nn.Module]  # modules whose forward this thread runs under our no_grad

    def __init__(self) -> None:
        self.active = []


_state = _State()
_enabled = False
#: The modules the program put in eval mode, by id (they carry our hooks unless parked).
_wanted: dict[int, weakref.ref[torch.nn.Module]] = {}
_parked = False
_other_threads = getattr(_thread, "_count", lambda: threading.active_count() - 1)


@dataclass
class _NoGradSite:
    model: str
    type_name: str
    filename: str
    lineno: int


#: The call sites whose eval-mode forward ran under no_grad, for the backward error message.
_sites: dict[tuple[str, int], _NoGradSite] = {}


class _Hook:
    """A forward hook of ours: found by identity, deep-copied as itself, pickled as a built-in no-op."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, (None, "__init__"))

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return self


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in value.values())
    return False


def _nested(frame: FrameType | None) -> bool:
    """True when, above this module's own ``_call_impl``, another module's ``_call_impl`` is running."""
    seen = 0
    while frame is not None:
        if frame.f_code is _call_impl_code:
            seen += 1
            if seen > 1:
                return True
        frame = frame.f_back
    return False


def _message(frame: FrameType, module: torch.nn.Module) -> str:
    name = callee(frame) or "model"
    kind = type(module).__name__
    _sites[(frame.f_code.co_filename, frame.f_lineno)] = _NoGradSite(name, kind, frame.f_code.co_filename,
                                                                      frame.f_lineno)
    return (f"{CODE} {name} ({kind}) is in eval mode with autograd on: eval() does not disable gradients, so this "
            f"forward would keep every activation for a backward that never comes; safetorch ran it under "
            f"torch.no_grad(). Write: `with torch.no_grad():` around the evaluation (or `with torch.enable_grad():` "
            f"to train through an eval-mode forward)")


class _PreHook(_Hook):
    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        __tracebackhide__ = True  # noqa: F841
        try:
            # Cheapest first: a validation loop under no_grad leaves at the first test.
            if (not _is_grad_enabled() or _state.explicit or not _enabled or module.training or _is_compiling()
                    or any(map(_requires_grad, args)) or any(map(_requires_grad, kwargs.values()))
                    or not any(p.requires_grad for p in module.parameters())):
                return None
            frame = sys._getframe(1)
            if _nested(frame):
                return None
            caller = user_frame(frame)
            if caller is None:
                return None
            report(CODE, caller, lambda: _message(caller, module))
            _set_grad_enabled(False)
            _state.active.append(module)
        except Exception as exc:  # strict-mode findings pass through internal_error
            internal_error(CODE, exc)
        return None


class _PostHook(_Hook):
    __slots__ = ()

    def __call__(self, module: torch.nn.Module, *rest: Any) -> None:
        # Called as (module, args, kwargs, output), or (module, args, output) when the forward raised.
        active = _state.active
        if active and active[-1] is module:
            active.pop()
            _set_grad_enabled(True)


_PRE = _PreHook()
_POST = _PostHook()


# Our hooks sit under fixed keys (torch's own handle ids count up from 0): attaching and detaching are a few dict
# operations, with no scan, no RemovableHandle, and nothing that grows when eval() and train() alternate.
_PRE_KEY = -0x5AFE
_POST_KEY = -0x5AFF
_TABLES = (
    ("_forward_pre_hooks", _PRE_KEY, _PRE, ("_forward_pre_hooks_with_kwargs",)),
    ("_forward_hooks", _POST_KEY, _POST, ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
)


def _has_ours(module: torch.nn.Module) -> bool:
    return module.__dict__.get("_forward_pre_hooks", {}).get(_PRE_KEY) is _PRE


def _detach(module: torch.nn.Module) -> None:
    d = module.__dict__
    for table, key, _, extras in _TABLES:
        if key in d.get(table, ()):
            del d[table][key]
            for extra in extras:
                d.get(extra, {}).pop(key, None)


def _attach(module: torch.nn.Module) -> None:
    d = module.__dict__
    for table, key, hook, extras in _TABLES:
        d[table][key] = hook  # replaces a relic of a pickled copy (a no-op) under the same key
        for extra in extras:
            d.setdefault(extra, {})[key] = True  # a torch without the table simply ignores it


def _should_park() -> bool:
    """Grad mode is off in the only thread and no forward of ours is running (its post hook must stay)."""
    return not _is_grad_enabled() and not _state.active and _other_threads() == 0


def _apply(park: bool) -> None:
    global _parked
    _parked = park
    for ref in list(_wanted.values()):
        module = ref()
        if module is not None:
            (_detach if park else _attach)(module)


def _repark() -> None:
    """After a change of grad mode: park or unpark the hooks when the answer changed. Called only while `_wanted`."""
    try:
        park = _should_park()
        if park is not _parked:
            _apply(park)
    except Exception as exc:
        internal_error(CODE, exc)


def _want(module: torch.nn.Module) -> None:
    key = id(module)
    _wanted[key] = weakref.ref(module, lambda _, key=key: _wanted.pop(key, None))
    _apply(_should_park())


def _unwant(module: torch.nn.Module) -> None:
    _wanted.pop(id(module), None)
    _detach(module)


_train_code = torch.nn.Module.train.__code__


def _script(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """TorchScript compiles a module's hooks with it: ours are taken off while it compiles, and put back."""
    obj = args[0] if args else kwargs.get("obj")
    hidden = []
    try:
        if isinstance(obj, torch.nn.Module):
            hidden = [m for m in obj.modules() if _has_ours(m)]
            for m in hidden:
                _detach(m)
    except Exception as exc:
        internal_error(CODE, exc)
    try:
        return wrapped(*args, **kwargs)
    finally:
        for m in hidden:
            if not _parked or id(m) not in _wanted:  # a parked module gets them back when grad mode comes on
                _attach(m)


def _train(original: Any) -> Any:
    """``Module.train``, as a plain function (see `Registry.replace`): torch's ``train()`` calls it again for every
    child, so a model of 150 modules calls it 150 times per ``train()``/``eval()``.

    Hooks go on the module whose eval() the program called, not on each child a parent's train() recurses into:
    the children's forwards run inside the parent's, where ST003 leaves them alone anyway."""

    def train(self: Any, mode: bool = True) -> Any:
        result = original(self, mode)
        if _is_compiling():
            return result
        try:
            if self.training:
                if id(self) in _wanted or _PRE_KEY in self.__dict__.get("_forward_pre_hooks", ()):
                    _unwant(self)
                if _state.active and any(m is self for m in _state.active):
                    # A KeyboardInterrupt inside our no_grad forward skips the always-called hook (torch calls it
                    # for Exception only): heal when the program goes back to training, e.g. in the next cell.
                    _state.active = [m for m in _state.active if m is not self]
                    _set_grad_enabled(True)
            elif sys._getframe(1).f_code is not _train_code and not isinstance(self, torch.jit.ScriptModule):
                _want(self)
        except Exception as exc:
            internal_error(CODE, exc)
        return result

    return train


# --- explicit grad mode, per thread ---------------------------------------------------------------------------


def _enable_enter(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    instance._safetorch_explicit = _state.explicit
    _state.explicit = True
    result = wrapped(*args, **kwargs)
    if _wanted:
        _repark()
    return result


def _restore_exit(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _state.explicit = getattr(instance, "_safetorch_explicit", False)
    result = wrapped(*args, **kwargs)
    if _wanted:
        _repark()
    return result


def _set_init(original: Any) -> Any:
    """``set_grad_enabled.__init__``, which sets the mode (torch's no_grad and optimizer steps call it too)."""

    def __init__(self: Any, mode: bool) -> None:  # torch's signature since 1.x; no **kwargs dict per call
        original(self, mode)
        try:
            explicit = _state.explicit
            self._safetorch_explicit = explicit
            # torch itself calls set_grad_enabled(prev) to restore a mode (no_grad.__exit__, optimizer steps): that
            # is not the program asking. Only a change of the flag needs to look at the caller.
            if bool(self.mode) is not explicit and not is_internal(sys._getframe(1).f_code):
                _state.explicit = not explicit
            if _wanted:
                _repark()
        except Exception as exc:
            internal_error(CODE, exc)

    return __init__


def _repark_after(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``inference_mode`` switches grad mode in C++: park or unpark after its ``__enter__`` and ``__exit__``."""
    result = wrapped(*args, **kwargs)
    if _wanted:
        _repark()
    return result


# --- the backward error -----------------------------------------------------------------------------------------


def _backward_message(error: BaseException) -> str:
    sites = list(_sites.values())[-3:]
    where = "; ".join(f"{s.model} ({s.type_name}) at {s.filename}:{s.lineno}" for s in sites)
    first = sites[-1].model if sites else "model"
    return (f"{CODE} backward() failed: {error}. safetorch ran the eval-mode forward of {where} under "
            f"torch.no_grad(), so its output carries no graph. To train through it: call {first}.train() before the "
            f"forward, or wrap the forward in `with torch.enable_grad():`, or switch this check off with "
            f"SAFETORCH_IGNORE=ST003.")


def _backward_error(error: RuntimeError) -> BaseException | None:
    if _sites and "does not require grad" in str(error):
        return SafetorchError(_backward_message(error), code=CODE)
    return None


def install(registry: Registry) -> None:
    global _enabled
    _enabled = True
    registry.replace(torch.nn.Module, "train", _train, CODE)
    registry.wrap(torch.jit, "script", _script, CODE)
    registry.wrap(grad_mode.enable_grad, "__enter__", _enable_enter, CODE)
    registry.wrap(grad_mode.enable_grad, "__exit__", _restore_exit, CODE)
    registry.replace(grad_mode.set_grad_enabled, "__init__", _set_init, CODE)
    registry.wrap(grad_mode.set_grad_enabled, "__exit__", _restore_exit, CODE)
    registry.wrap(grad_mode.set_grad_enabled, "__call__", _restore_exit, CODE)
    registry.wrap(grad_mode.inference_mode, "__enter__", _repark_after, CODE)
    registry.wrap(grad_mode.inference_mode, "__exit__", _repark_after, CODE)
    _backward.listen(CODE, on_error=_backward_error)


def uninstall() -> None:
    """Take our hooks off every module we attached them to; hooks on copies we never saw become no-ops."""
    global _enabled, _parked
    _enabled = False
    _backward.unlisten(CODE)
    _apply(True)  # every hook off
    _wanted.clear()
    _parked = False
