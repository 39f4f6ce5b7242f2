"""The one global optimizer step pre-hook that ST010 and ST011 share, and how often they look.

Design rules: torch calls the global step pre-hooks before every ``step()`` of every optimizer (``Optimizer``'s
``profile_hook_step``), so one hook is all a training step pays, registered while a listener exists. What a step
costs a listener is its business; this module only says *whether* to look: every one of an optimizer's first
`FIRST` steps, then two consecutive steps in every `EVERY` (a listener that compares a step with the one before
it gets a pair). A ``step(closure)`` (LBFGS, Lightning's automatic optimisation) is never
looked at: the closure computes the gradients inside ``step()``, after the pre-hook ran.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._callsite import method_call
from ._compat import is_compiling
from ._report import report, user_frame

#: Every step of an optimizer's first FIRST steps is looked at, then steps EVERY*k and EVERY*k + 1.
FIRST = 8
EVERY = 1024

#: ``listener(optimizer, step_number, caller)``: ``caller`` is the frame that called ``step()`` (torch's wrapper's
#: caller); `safetorch._report.user_frame` walks out of a framework's frames when there is a finding.
Listener = Callable[[Optimizer, int, FrameType], None]

_listeners: dict[str, Listener] = {}
_now: tuple[Listener, ...] = ()
#: id(optimizer) -> [weak reference to it, steps counted]. Not a WeakKeyDictionary: its Python-level get/set cost
#: about a microsecond per step; this is a dict lookup and a weakref call. Dead entries are dropped as it grows.
_steps: dict[int, list[Any]] = {}
_handle: Any = None


def _entry(optimizer: Optimizer) -> list[Any]:
    if len(_steps) >= 256:
        for key in [k for k, (ref, _) in _steps.items() if ref() is None]:
            del _steps[key]
    entry = _steps[id(optimizer)] = [weakref.ref(optimizer), 0]
    return entry


def _before_step(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if len(args) > 1 and args[1] is not None or kwargs and kwargs.get("closure") is not None:  # args[0]: optimizer
        return
    entry = _steps.get(id(optimizer))
    if entry is None or entry[0]() is not optimizer:
        entry = _entry(optimizer)
    n = entry[1] = entry[1] + 1
    if n > FIRST and n % EVERY > 1 or is_compiling():
        return
    caller = sys._getframe(2)  # the hook <- torch's step wrapper <- the caller of step()
    for listener in _now:
        listener(optimizer, n, caller)


def listen(code: str, listener: Listener) -> None:
    global _now, _handle
    _listeners[code] = listener
    _now = tuple(_listeners.values())
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_before_step)


def unlisten(code: str) -> None:
    global _now, _handle
    _listeners.pop(code, None)
    _now = tuple(_listeners.values())
    if not _listeners and _handle is not None:
        _handle.remove()
        _handle = None


def looked_at(optimizer: Optimizer) -> int:
    """How many steps of ``optimizer`` the hook has counted (for the tests)."""
    entry = _steps.get(id(optimizer))
    return entry[1] if entry is not None and entry[0]() is optimizer else 0


def report_step(code: str, caller: FrameType, message: Callable[[str], str]) -> None:
    """Report ``code`` at the user's ``step()`` line; ``message`` gets the optimizer's name there (``opt``)."""
    __tracebackhide__ = True  # noqa: F841
    frame = user_frame(caller)
    if frame is not None:
        name = method_call(frame, "step", 0)[0] or "optimizer"
        report(code, frame, lambda: message(name))
