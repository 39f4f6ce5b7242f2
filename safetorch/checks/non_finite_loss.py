"""ST006: a NaN or infinite loss reaching ``backward()``, reported at the line that called backward.

The first 64 backwards are looked at, then one in 32 (`safetorch._deferred.schedule`), on every device: a loss that
diverged stays NaN (the step after a NaN loss makes the weights NaN) and is found within 32 steps, and a backward not
looked at costs one ``next()`` (a CPU loss's ``item()`` at every backward was a third of what safetorch added to a
tiny model's training step). On the CPU a looked-at value is checked directly (a scalar loss's ``item()``). On an
accelerator no host synchronisation is added: the loss is handed to `safetorch._deferred` (a non-blocking copy into
pinned host memory and an event; a vector's ``isfinite().all()`` first), and the result is read once the device has
computed it: at a later ``backward()``, and at exit (before the exit summary). A looked-at backward there costs the
copy, the event, and a remembered place (code object, instruction, globals: O(1), whatever the length of the training
function); the loss's name, the line number and the message are worked out only for a loss that was not finite. In
strict mode the finding raises at the backward that reads it, naming the line of the backward that started from the
bad loss.
"""

from __future__ import annotations

import math
from types import FrameType
from typing import Any

import torch

from .. import _backward, _deferred
from .._callsite import Spot, method_call
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, report, report_at
from .._rule import Rule

CODE = "ST006"


class NonFiniteLossWarning(SafetorchWarning):
    """ST006: a NaN or infinite loss reached ``backward()``."""

    code = "ST006"


RULE = Rule("ST006", "non-finite-loss", NonFiniteLossWarning,
            "a NaN or infinite loss reaching backward()", per_rank=True)

CAUSES = ("the usual causes: a learning rate too high (try a smaller one, or gradient clipping), log(0) or "
          "log of a negative number, a division by zero (add an epsilon), or bad data (NaN/Inf in inputs or "
          "labels); torch.autograd.set_detect_anomaly(True) finds the operation that produced it")


def _describe(t: torch.Tensor) -> str:
    if t.numel() == 1:
        return f"is {t.item()}"
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f"has {nan} NaN and {inf} infinite values among its {t.numel()} elements"


def _message(name: str, value: str) -> str:
    return f"{CODE} {name} {value} when backward() starts from it: its gradients will be NaN; {CAUSES}"


def _name(frame: FrameType | Spot, method: str) -> str:
    if method == "backward":
        receiver, _ = method_call(frame, "backward", 1 << 30)  # never read as a call through the class
        return receiver or "the loss"
    return "the tensor given to torch.autograd.backward"


def _deferred_ready(value: Any, payload: tuple[Any, ...]) -> None:
    """The device has computed a loss's check: the loss itself (one element), or whether all of it is finite."""
    code, lasti, module_globals, method, numel = payload
    if numel == 1:
        if value - value == 0:
            return
        describe = f"is {value}"
    elif value:
        return
    else:
        describe = f"has NaN or infinite values among its {numel} elements"
    spot = Spot.at(code, lasti, module_globals)
    report_at(CODE, code.co_filename, spot.f_lineno, module_globals, lambda: _message(_name(spot, method), describe))


def _defer(t: torch.Tensor, frame: FrameType, method: str) -> None:
    """Queue the check of a loss on an accelerator: the value itself (one element) or ``isfinite().all()``. What is
    kept is the place (code object, instruction, globals): O(1); the line and the name are worked out for a finding."""
    numel = t.numel()
    if numel == 1 and not t.is_complex():
        value = t if t.dim() == 0 else t.detach().reshape(())
    else:
        value = torch.isfinite(t.detach()).all()
    _deferred.check(value, _deferred_ready, (frame.f_code, frame.f_lasti, frame.f_globals, method, numel), CODE)


def _defer_loss(t: torch.Tensor) -> bool:
    """A 0-dim loss on an accelerator, at a looked-at backward: queue its value. False when no backward patch is on
    the stack (then the general path decides)."""
    caller = _backward.caller()
    if caller is None:
        return False
    frame, method = _backward.origin(caller)
    if frame is not None:  # None: torch's own backward (a checkpoint's recomputation), not the program's loss
        _deferred.check(t, _deferred_ready, (frame.f_code, frame.f_lasti, frame.f_globals, method, 1), CODE)
    return True


def _finite(t: torch.Tensor) -> bool:
    if t.numel() == 1:
        value = t.item()  # a scalar loss on the CPU: 0.3 µs, where isfinite().all() costs 10
        if isinstance(value, complex):
            return math.isfinite(value.real) and math.isfinite(value.imag)
        return not isinstance(value, float) or math.isfinite(value)
    return not (t.is_floating_point() or t.is_complex()) or bool(torch.isfinite(t.detach()).all())


def _check(tensors: Any) -> None:
    caller = _backward.caller()
    if caller is None:
        return
    for t in (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors or ()):
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        if _deferred.is_deferred(t):
            if t.is_floating_point() or t.is_complex():
                frame, method = _backward.origin(caller)
                if frame is not None:
                    _defer(t, frame, method)
        elif not _finite(t):
            frame, method = _backward.origin(caller)
            if frame is not None:
                report(CODE, frame, lambda t=t, f=frame, m=method: _message(_name(f, m), _describe(t.detach())))


def _before_backward(tensors: Any) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        if isinstance(tensors, torch.Tensor):  # a looked-at backward (`_deferred.schedule`, asked by the patch)
            if tensors.is_cpu and not _deferred.FORCED:
                # A looked-at loss on the CPU: no call, no loop, no frame walk. `v - v == 0` holds for every finite
                # int, float or complex, and for no NaN or infinity. item() raises for any other number of elements
                # than one, which a backward from a loss rarely has (asking numel() first costs every backward).
                try:
                    value = tensors.item()
                except Exception:
                    if _finite(tensors):
                        return
                else:
                    if value - value == 0:
                        return
            else:
                if _deferred.pending:
                    _deferred.poll()
                if tensors.dim() == 0 and tensors.is_floating_point() and _defer_loss(tensors):
                    return  # queued
        elif _deferred.pending:
            _deferred.poll()
        _check(tensors)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def install(registry: Registry) -> None:
    _backward.listen(CODE, before=_before_backward, schedule=_deferred.schedule)


def uninstall() -> None:
    _backward.unlisten(CODE)
    _deferred.clear(CODE)
