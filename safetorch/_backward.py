"""The one wrapper on ``torch.autograd.backward`` that checks share (ST003 translates its error, ST006 checks the
tensor it starts from).

Design rules: ``Tensor.backward`` calls ``torch.autograd.backward``, so patching that single function sees every
backward, and one layer is all a training step pays: a plain function put in place by `Registry.replace`, since
every training step calls it. A check adds a listener at install and removes it at uninstall; the patch lives as
long as one listener does. A listener gets the tensors the backward starts from; when it has a finding it asks
`caller` for the frame that called ``torch.autograd.backward`` (materialising a frame object costs, so the common
case never does).
"""

from __future__ import annotations

import inspect
import itertools
import sys
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
            if _before_now and not (_dynamo_compiling() or _flags._is_compiling_flag):  # see _compat.dynamo_compiling
                for before in _before_now:
                    before(tensors)  # each listener guards its own logic; strict mode raises here
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
            if _before_now and not (_dynamo_compiling() or _flags._is_compiling_flag):  # see _compat.dynamo_compiling
                tensors = args[0] if args else kwargs.get("tensors")
                for before in _before_now:
                    before(tensors)
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
    _update()


def _update() -> None:
    if not _before and not _on_error and _on_due is None:
        registry.restore(GROUP)


def listen(code: str, before: Before | None = None, on_error: OnError | None = None) -> None:
    global _before_now
    if before is not None:
        _before[code] = before
    if on_error is not None:
        _on_error[code] = on_error
    _before_now = tuple(_before.values())
    registry.replace(torch.autograd, "backward", _dispatch, GROUP)


def unlisten(code: str) -> None:
    global _before_now
    _before.pop(code, None)
    _on_error.pop(code, None)
    _before_now = tuple(_before.values())
    _update()
