"""The one global optimizer step pre-hook that ST010 and ST011 share, and when it stands.

Design rules: torch calls the global step pre-hooks before every ``step()`` of every optimizer (``Optimizer``'s
``profile_hook_step``), so a registered hook costs every step (about 3k instructions for this one's bookkeeping). It
stands only while an optimizer has steps left to be looked at, its *window*: an optimizer's first `FIRST` steps (from
its construction, or from the first step seen when it was built before safetorch was installed), then, once every
`EVERY` backwards, the next `SAMPLE` steps of every optimizer alive (two consecutive steps: a listener that compares a
step with the one before it gets a pair). A window that has not closed `EVERY` backwards after the hook was put in
place closes then (an optimizer that no longer steps), except the first window of an optimizer that has never
stepped. Between windows no hook stands and a step pays nothing; the backwards are counted by the one backward patch
(`safetorch._backward.call_after`), which also takes the hook away, at the next backward after the last window
closes: torch iterates over its hook dict while it calls a hook, whose size must not change then.

A ``step(closure)`` (LBFGS, Lightning's automatic optimisation) computes its gradients inside ``step()``, after the
pre-hook ran: the listeners that read gradients before a step are not called for it; a *closure listener* may hand
back a closure of its own that calls the user's (ST011 looks at what the closure's backwards do), and the step counts
in the window as any other. A program that never calls backward (gradients set by hand) gets an optimizer's first
steps looked at, and no sample.

An *after listener* is called right after a looked-at step (a global post-hook that stands exactly when the pre-hook
does), for a check that compares what the step did (ST018).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import _backward
from ._callsite import method_call
from ._compat import is_compiling
from ._hooks import untallied
from ._patch import registry
from ._report import internal_error, report, user_frame

GROUP = "core:steps"

#: An optimizer's first FIRST steps are looked at; then, every EVERY backwards, the next SAMPLE steps of each.
FIRST = 8
EVERY = 1024
SAMPLE = 2

#: ``listener(optimizer, look, caller, more)``: ``look`` counts the optimizer's looked-at steps (1, 2, ...); ``more``
#: says whether its next step will be looked at too (then it is look + 1). ``caller`` is the frame that called
#: ``step()`` (torch's wrapper's caller); `safetorch._report.user_frame` walks out of a framework's frames when there
#: is a finding.
Listener = Callable[[Optimizer, int, FrameType, bool], None]

#: ``after(optimizer, look, caller)``: right after the looked-at step ``look`` (not after a ``step(closure)``).
After = Callable[[Optimizer, int, FrameType], None]
#: ``wrap(optimizer, closure, caller)`` returns the closure that ``step()`` is to call instead of ``closure``.
ClosureListener = Callable[[Optimizer, Callable[[], Any], FrameType], Callable[[], Any]]

_listeners: dict[str, Listener] = {}
_now: tuple[Listener, ...] = ()
_after: dict[str, After] = {}
_after_now: tuple[After, ...] = ()
_closures: dict[str, ClosureListener] = {}
#: id(optimizer) -> the look of its step in progress, set by the pre-hook for the post-hook (after listeners only).
_stepping: dict[int, int] = {}
_post_handle: Any = None
#: id(optimizer) -> [weak reference to it, steps looked at, steps left in its window]. Not a WeakKeyDictionary: its
#: Python-level get/set cost about a microsecond per step; this is a dict lookup and a weakref call.
_steps: dict[int, list[Any]] = {}
_handle: Any = None


def _entry(optimizer: Optimizer) -> list[Any]:
    if len(_steps) >= 256:
        for key in [k for k, (ref, _, _) in _steps.items() if ref() is None]:
            del _steps[key]
    entry = _steps[id(optimizer)] = [weakref.ref(optimizer), 0, FIRST]
    return entry


def _known(optimizer: Optimizer) -> list[Any]:
    entry = _steps.get(id(optimizer))
    if entry is None or entry[0]() is not optimizer:
        entry = _entry(optimizer)
    return entry


def _arm() -> None:
    """Put the hook in place (when it is not), for at most `EVERY` backwards from now."""
    global _handle, _post_handle
    if not _listeners:
        return
    if _handle is None:
        _handle = untallied(register_optimizer_step_pre_hook, _before_step)
    if _after and _post_handle is None:
        _post_handle = untallied(register_optimizer_step_post_hook, _after_step)
    _backward.call_after(EVERY, _tick)


def _disarm() -> None:
    global _handle, _post_handle
    if _handle is not None:
        _handle.remove()
        _handle = None
    if _post_handle is not None:
        _post_handle.remove()
        _post_handle = None
    _stepping.clear()


def _open(entry: list[Any]) -> bool:
    return bool(entry[2]) and entry[0]() is not None


def _window_closed() -> None:
    """An optimizer's window closed: when no other is open, take the hook away at the next backward."""
    if not any(_open(entry) for entry in _steps.values()):
        _backward.call_after(1, _tick)


def _tick() -> None:
    """Called by the backward patch. With the hook in place (the last window closed, or `EVERY` backwards have passed
    since it was put there): close the window of every optimizer that has stepped, and take the hook away, unless a
    new optimizer has yet to step (then look again `EVERY` backwards later). Without it: open a window of `SAMPLE`
    steps for every optimizer alive and put the hook back."""
    global _handle
    try:
        if _handle is not None:
            for entry in _steps.values():
                if entry[1]:
                    entry[2] = 0
            if not any(_open(entry) for entry in _steps.values()):
                _disarm()
            _backward.call_after(EVERY, _tick)
            return
        for key, entry in list(_steps.items()):
            if entry[0]() is None:
                del _steps[key]
            else:
                entry[2] = SAMPLE
        if _steps:
            _arm()
        else:
            _backward.call_after(EVERY, _tick)
    except Exception as exc:
        internal_error("ST010", exc)


def _before_step(optimizer: Optimizer, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if is_compiling():
        # A compiled step (dynamo inlines the hook): no counting, which dynamo would guard (a recompile every step)
        return None
    entry = _steps.get(id(optimizer))
    if entry is None or entry[0]() is not optimizer:
        entry = _entry(optimizer)
    if not entry[2]:
        return None  # its window is closed; another optimizer's keeps the hook in place
    closure = args[1] if len(args) > 1 else kwargs.get("closure") if kwargs else None  # args[0]: the optimizer
    left = entry[2] = entry[2] - 1
    n = entry[1] = entry[1] + 1
    if not left:
        _window_closed()
    caller = sys._getframe(2)  # the hook <- torch's step wrapper <- the caller of step()
    if closure is not None:
        return _wrap_closure(optimizer, closure, caller, args, kwargs)
    for listener in _now:
        listener(optimizer, n, caller, left > 0)
    if _after:
        _stepping[id(optimizer)] = n
    return None


def _wrap_closure(optimizer: Optimizer, closure: Callable[[], Any], caller: FrameType, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Hand ``step()`` the closure the closure listeners make of the user's (None: nothing to change)."""
    if not _closures:
        return None
    try:
        wrapped = closure
        for make in _closures.values():
            wrapped = make(optimizer, wrapped, caller)
        if wrapped is closure:
            return None
        if len(args) > 1:
            return (args[0], wrapped, *args[2:]), kwargs
        return args, {**kwargs, "closure": wrapped}
    except Exception as exc:
        internal_error("ST011", exc)
        return None


def _after_step(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if is_compiling():
        return
    n = _stepping.pop(id(optimizer), None)
    if n is None:
        return  # not a looked-at step (another optimizer's window keeps the hooks in place)
    caller = sys._getframe(2)  # the hook <- torch's step wrapper <- the caller of step()
    for after in _after_now:
        after(optimizer, n, caller)


def _constructed(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Optimizer.__init__``: a new optimizer's first steps are looked at, whenever it is built."""
    result = wrapped(*args, **kwargs)
    try:
        if isinstance(instance, Optimizer):
            _known(instance)[2] = FIRST
            _arm()  # and `EVERY` backwards for its first steps
    except Exception as exc:
        internal_error("ST010", exc)
    return result


def _noop(optimizer: Optimizer, look: int, caller: FrameType, more: bool) -> None:
    pass


def listen(code: str, listener: Listener | None = None, after: After | None = None,
           closure: ClosureListener | None = None) -> None:
    """Add ``code``'s listeners: before a looked-at step, right after it, and around a ``step(closure)``'s closure."""
    global _now, _after_now
    _listeners[code] = listener or _noop
    _now = tuple(f for f in _listeners.values() if f is not _noop)
    if after is not None:
        _after[code] = after
        _after_now = tuple(_after.values())
    if closure is not None:
        _closures[code] = closure
    registry.wrap(Optimizer, "__init__", _constructed, GROUP)
    _arm()


def unlisten(code: str) -> None:
    global _now, _after_now, _post_handle
    _listeners.pop(code, None)
    _after.pop(code, None)
    _closures.pop(code, None)
    _now = tuple(f for f in _listeners.values() if f is not _noop)
    _after_now = tuple(_after.values())
    if not _after and _post_handle is not None:
        _post_handle.remove()
        _post_handle = None
    if not _listeners:
        _disarm()
        _backward.cancel_call()
        registry.restore(GROUP)
        _steps.clear()


def looked_at(optimizer: Optimizer) -> int:
    """How many steps of ``optimizer`` the hook has looked at (for the tests)."""
    entry = _steps.get(id(optimizer))
    return entry[1] if entry is not None and entry[0]() is optimizer else 0


def optimizers() -> list[Optimizer]:
    """The live optimizers the hook knows (built since install, or seen stepping): ST020 asks which parameters they
    hold."""
    return [optimizer for ref, _, _ in list(_steps.values()) if (optimizer := ref()) is not None]


def armed() -> bool:
    """Whether the step hook stands now (for the tests)."""
    return _handle is not None


def report_step(code: str, caller: FrameType, message: Callable[[str], str]) -> None:
    """Report ``code`` at the user's ``step()`` line; ``message`` gets the optimizer's name there (``opt``)."""
    __tracebackhide__ = True  # noqa: F841
    frame = user_frame(caller)
    if frame is not None:
        name = method_call(frame, "step", 0)[0] or "optimizer"
        report(code, frame, lambda: message(name))
