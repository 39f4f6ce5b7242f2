"""The one wrapper on ``torch.autograd.backward`` that checks share (ST003 translates its error, ST006 checks the
tensor it starts from).

Design rules: ``Tensor.backward`` calls ``torch.autograd.backward``, so patching that single function sees every
backward, and one layer is all a training step pays: a plain function put in place by `Registry.replace`, since
every training step calls it. A check adds a listener while it has something to do at a backward and removes it
after; the patch lives as long as one listener (or a record of the `recent` backwards) does. A listener gets the
tensors the backward starts from; when it has a finding it asks `caller` for the frame that called
``torch.autograd.backward`` (materialising a frame object costs, so the common case never does).

A listener is a Python call on every backward (about 2k instructions, with the compile check that must precede the
first: measured), so what every backward needs is done by the patch itself: it counts the backwards (`count`), keeps
weak references to the tensors of the last few (`recent`, for the checks that `record`), and asks a *sampled*
listener's schedule (one ``next()`` in C) before it calls that listener: a check that looks at one backward in
many is called only for those.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch

from ._compat import compile_flags, dynamo_compiling
from ._exceptions import SafetorchError
from ._patch import registry
from ._report import is_internal, user_frame
from ._tracebacks import hide_own_frames

GROUP = "core:backward"

#: ``before(tensors)``, called directly by the patch; `caller` (from inside it) gives the frame that called
#: ``torch.autograd.backward``, and `origin` turns that into the user's frame.
Before = Callable[[Any], None]
#: ``on_error(error)`` returns an exception to raise instead of torch's RuntimeError, or None.
OnError = Callable[[RuntimeError], BaseException | None]

_before: dict[str, Before] = {}
_on_error: dict[str, OnError] = {}
_before_now: tuple[Before, ...] = ()  # the listeners as a tuple: what every backward iterates
#: Sampled listeners: called for a backward from a tensor only when ``next(schedule)`` is True (for one from a
#: sequence of tensors, always). code -> (listener, the function that makes its schedule).
_sampled: dict[str, tuple[Before, Callable[[], Iterator[bool]]]] = {}
_sampled_now: tuple[Before, ...] = ()
_schedule: Iterator[bool] = itertools.repeat(False)
#: Whether any listener stands: the one test the patch makes before the compile check.
_listening = False
#: The checks that `record`; while one does, `recent` holds weak references to the tensors the last backwards
#: started from (a tensor's, one per backward: no callback, no frame).
_recording: set[str] = set()
recent: deque[weakref.ref[torch.Tensor]] = deque(maxlen=8)
_ref = weakref.ref
_Tensor = torch.Tensor
_tensor_backward_code = torch.Tensor.backward.__code__
_next = next

#: When to call `_on_due` (one client, `safetorch._steps`, which samples optimizer steps by backwards counted): an
#: iterator over the backwards left to wait, which every backward advances (a ``next()`` in C; a global counter's
#: increment and store cost a quarter more).
_NEVER: Iterator[int] = itertools.repeat(0)
_countdown: Iterator[int] = _NEVER
#: Backwards started through the patch since it first stood: a check that must know whether any backward ran between
#: two events compares two readings (ST019). One global increment per backward.
count = 0
_on_due: Callable[[], None] | None = None
_dynamo_compiling = dynamo_compiling
_recent_append = recent.append
_flags = compile_flags


def origin(caller: FrameType) -> tuple[FrameType | None, str]:
    """(the user's frame, "backward" or "autograd.backward"), or (None, "") when torch itself called backward."""
    if caller.f_code is _tensor_backward_code:
        return user_frame(caller), "backward"
    if is_internal(caller.f_code):
        return None, ""
    return caller, "autograd.backward"


#: ``torch.autograd.backward``'s parameters, the same from torch 1.8 to today. With them the patch calls torch's
#: function with a plain call, which the interpreter runs in its own loop; ``original(*args, **kwargs)`` enters a new
#: one (1.7k instructions more per backward, measured).
_PARAMETERS = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")


def _parameters(function: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _dispatch(original: Any) -> Any:
    """A plain function, not a wrapt proxy (see `Registry.replace`): every training step calls it. Its signature is
    torch's own where torch's is the one known, else ``(*args, **kwargs)``."""
    return (_dispatch_known if _parameters(original) == _PARAMETERS else _dispatch_any)(original)


def _dispatch_known(original: Any) -> Any:
    def backward(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None, create_graph: Any = False,
                 grad_variables: Any = None, inputs: Any = None) -> Any:
        __tracebackhide__ = True  # noqa: F841
        global count
        try:
            count += 1
            if _next(_countdown, None) is None:
                _call_due()
            if (_listening or _recording) and not (_dynamo_compiling() or _flags._is_compiling_flag):  # _compat
                if _recording:
                    if isinstance(tensors, _Tensor):
                        _recent_append(_ref(tensors))
                    else:
                        _record_many(tensors)
                if _listening:
                    for before in _before_now:
                        before(tensors)  # each listener guards its own logic; strict mode raises here
                    if _sampled_now and (not isinstance(tensors, _Tensor) or _next(_schedule)):
                        for before in _sampled_now:
                            before(tensors)
            if not _on_error:
                return original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
            try:
                return original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
            except RuntimeError as error:
                replacement = _replacement(error)
                if replacement is not None:
                    raise replacement from error
                raise
        except BaseException as exc:  # no frame of ours in the traceback of what passes through
            hide_own_frames(exc)
            raise

    return backward


def _dispatch_any(original: Any) -> Any:
    """`_dispatch` for a ``torch.autograd.backward`` whose parameters are not the known ones (none of torch 2.1–2.13).
    It repeats `_dispatch_known`'s few lines rather than share a helper: a helper call would cost every backward."""

    def backward(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        global count
        try:
            count += 1
            if _next(_countdown, None) is None:
                _call_due()
            if (_listening or _recording) and not (_dynamo_compiling() or _flags._is_compiling_flag):  # _compat
                _before_backward(args[0] if args else kwargs.get("tensors"))
            try:
                return original(*args, **kwargs)
            except RuntimeError as error:
                replacement = _replacement(error)
                if replacement is not None:
                    raise replacement from error
                raise
        except BaseException as exc:  # no frame of ours in the traceback of what passes through
            hide_own_frames(exc)
            raise

    return backward


def _before_backward(tensors: Any) -> None:
    """What `_dispatch_known`'s patch does inline before torch's backward, for `_dispatch_any`'s."""
    if _recording:
        _record_many((tensors,) if isinstance(tensors, _Tensor) else tensors)
    if _listening:
        for before in _before_now:
            before(tensors)
        if _sampled_now and (not isinstance(tensors, _Tensor) or _next(_schedule)):
            for before in _sampled_now:
                before(tensors)


def _record_many(tensors: Any) -> None:
    try:
        recent.extend(_ref(t) for t in tuple(tensors or ()) if isinstance(t, _Tensor))
    except TypeError:
        pass  # not a sequence of tensors: torch raises its own error next


def _replacement(error: RuntimeError) -> BaseException | None:
    """What a listener's ``on_error`` raises instead of torch's error, or None."""
    if not isinstance(error, SafetorchError):
        for on_error in list(_on_error.values()):
            replacement = on_error(error)
            if replacement is not None:
                return replacement
    return None


_BACKWARD_CODES = frozenset({_dispatch_known(None).__code__, _dispatch_any(None).__code__})


def caller() -> FrameType | None:
    """From inside a listener: the frame that called ``torch.autograd.backward`` (the patch's caller)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code not in _BACKWARD_CODES:
        frame = frame.f_back
    return frame.f_back if frame is not None else None


def _call_due() -> None:
    global _countdown, _on_due
    callback, _countdown, _on_due = _on_due, _NEVER, None
    if callback is not None:
        callback()  # guards its own logic


def call_after(backwards: int, callback: Callable[[], None]) -> None:
    """Call ``callback`` at the start of the ``backwards``-th backward from now (replacing any earlier request)."""
    global _countdown, _on_due
    _countdown, _on_due = iter(range(max(backwards, 1) - 1)), callback
    registry.replace(torch.autograd, "backward", _dispatch, GROUP)


def cancel_call() -> None:
    global _countdown, _on_due
    _countdown, _on_due = _NEVER, None
    if not (_listening or _on_error or _recording):
        registry.restore(GROUP)


def _update() -> None:
    global _before_now, _sampled_now, _listening
    _before_now = tuple(_before.values())
    _sampled_now = tuple(before for before, _ in _sampled.values())
    _listening = bool(_before_now or _sampled_now)
    if _listening or _on_error or _on_due is not None or _recording:
        registry.replace(torch.autograd, "backward", _dispatch, GROUP)
    else:
        registry.restore(GROUP)


def listen(code: str, before: Before | None = None, on_error: OnError | None = None,
           schedule: Callable[[], Iterator[bool]] | None = None) -> None:
    """``before`` is called before every backward; with ``schedule``, only before those from a tensor for which the
    schedule it makes answers True (and every one from a sequence of tensors). One schedule stands for all the
    sampled listeners: the last one given."""
    global _schedule
    if before is not None:
        if schedule is not None:
            _sampled[code] = (before, schedule)
            _schedule = schedule()
        else:
            _before[code] = before
    if on_error is not None:
        _on_error[code] = on_error
    _update()


def unlisten(code: str) -> None:
    _before.pop(code, None)
    _sampled.pop(code, None)
    _on_error.pop(code, None)
    _update()


def restart_schedule() -> None:
    """The sampled listeners' schedule from its start again (a new process's, for the tests and the bench)."""
    global _schedule
    for _, schedule in list(_sampled.values())[-1:]:
        _schedule = schedule()


def record(code: str, on: bool = True) -> None:
    """While a check records, `recent` keeps weak references to the tensors the last backwards started from."""
    if on:
        _recording.add(code)
    else:
        _recording.discard(code)
        if not _recording:
            recent.clear()
    _update()


def was_recent(tensor: torch.Tensor) -> bool:
    """Whether one of the last backwards (`recent`) started from ``tensor``."""
    return any(ref() is tensor for ref in recent)
