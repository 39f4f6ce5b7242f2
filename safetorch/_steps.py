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

A ``step(closure)`` (LBFGS, Lightning's automatic optimisation) is never looked at: the closure computes the gradients
inside ``step()``, after the pre-hook ran; it closes that optimizer's window. A program that never calls backward
(gradients set by hand) gets an optimizer's first steps looked at, and no sample.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _backward
from ._callsite import method_call
from ._compat import is_compiling
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

_listeners: dict[str, Listener] = {}
_now: tuple[Listener, ...] = ()
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
    global _handle
    if not _listeners:
        return
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_before_step)
    _backward.call_after(EVERY, _tick)


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
                _handle.remove()
                _handle = None
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


def _before_step(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    entry = _steps.get(id(optimizer))
    if entry is None or entry[0]() is not optimizer:
        entry = _entry(optimizer)
    if not entry[2]:
        return  # its window is closed; another optimizer's keeps the hook in place
    if len(args) > 1 and args[1] is not None or kwargs and kwargs.get("closure") is not None:  # args[0]: optimizer
        entry[2] = 0
        _window_closed()
        return
    left = entry[2] = entry[2] - 1
    n = entry[1] = entry[1] + 1
    if not left:
        _window_closed()
    if is_compiling():
        return
    caller = sys._getframe(2)  # the hook <- torch's step wrapper <- the caller of step()
    for listener in _now:
        listener(optimizer, n, caller, left > 0)


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


def listen(code: str, listener: Listener) -> None:
    global _now
    _listeners[code] = listener
    _now = tuple(_listeners.values())
    registry.wrap(Optimizer, "__init__", _constructed, GROUP)
    _arm()


def unlisten(code: str) -> None:
    global _now, _handle
    _listeners.pop(code, None)
    _now = tuple(_listeners.values())
    if not _listeners:
        if _handle is not None:
            _handle.remove()
            _handle = None
        _backward.cancel_call()
        registry.restore(GROUP)
        _steps.clear()


def looked_at(optimizer: Optimizer) -> int:
    """How many steps of ``optimizer`` the hook has looked at (for the tests)."""
    entry = _steps.get(id(optimizer))
    return entry[1] if entry is not None and entry[0]() is optimizer else 0


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
