"""ST018: ``optimizer.step()`` with finite, non-zero gradients and a learning rate above 0 that left every sampled
parameter exactly as it was: the update went nowhere.

The causes: the optimizer's step writes into tensors the model no longer uses (a wrapper that swaps or restores the
parameters after ``step()``: master weights copied back over the update, an FSDP wrapper built after the optimizer),
or a backend that silently drops the update. (When the optimizer's tensors get no gradients at all, as with FSDP2's
``fully_shard`` applied after the optimizer was built, that is ST010's finding.)

How it is seen: in the shared step hooks (`safetorch._steps`: an optimizer's first steps, then a pair of steps every
1024 backwards), before a looked-at step, eight strided elements of the first two parameters that have a dense
gradient are copied with their gradients; right after the step (the post-hook, which runs after the optimizer's own
post-hooks, so a wrapper's restore is seen) they are compared. An element *counts* only where the update torch's math
makes is certain to move it: a finite, non-zero gradient, and an update size (``lr * |grad|`` for SGD-like steps,
``lr`` for the adaptive ones, whose first update is ``lr`` per element; RAdam's first, un-rectified steps are SGD with
momentum, ``lr * |m̂|``) above 64 units in the last place of the value
(an update below half an ulp leaves a float unchanged: bf16 weights with a tiny learning rate are not this bug).
ST018 is reported when at least one element counts and none of them changed.

Silent: ``lr == 0`` groups (warm-up from 0), ``maximize=True``, optimizers other than torch's SGD/Adam/AdamW/Adamax/
NAdam/RAdam/RMSprop/Rprop/Adagrad/Adadelta/ASGD (a custom one may not update on purpose), a step that GradScaler
skips (``scaler.step`` does not call ``step()`` then; a fused optimizer handed ``found_inf`` is not judged), sparse
gradients, ``step(closure)`` (the gradients are made inside the step). The decision is a bool on the parameters'
device, read through `safetorch._deferred`: on an accelerator the host never waits for it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.optim import Optimizer

from .. import _deferred, _steps
from .._callsite import Spot, method_call
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, report_at, user_frame
from .._rule import Rule

CODE = "ST018"
_K = 8  # elements sampled per parameter
_PARAMS = 2  # parameters sampled per step
_ULPS = 64  # an update counts when it is this many units in the last place of the value, or more


class StepChangedNothingWarning(SafetorchWarning):
    """ST018: ``optimizer.step()`` with non-zero gradients and lr > 0 changed none of the sampled parameters."""

    code = "ST018"


RULE = Rule("ST018", "step-changed-nothing", StepChangedNothingWarning,
            "optimizer.step() with non-zero gradients and lr > 0 that changed none of the sampled parameters",
            sampled=True)

#: How large torch's first update of an element is, by optimizer class: ``lr * |g|`` (SGD-like) or ``lr`` (adaptive:
#: Adam's first update is ``lr * g / |g|``, RMSprop's ``lr / sqrt(1 - alpha)``, Adagrad's ``lr``, Rprop's ``lr``).
#: Adadelta's is ``lr * sqrt(eps) * g / sqrt((1 - rho) g² + eps)``, at least ``lr * sqrt(eps) * |g| / sqrt(g² + eps)``.
_SGD_LIKE = {torch.optim.SGD, torch.optim.ASGD}
_ADAPTIVE = {torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
             torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adagrad}
_ADADELTA = {torch.optim.Adadelta}


@dataclass
class _Sample:
    param: torch.Tensor  # a strided view of _K elements of the parameter (it sees the step's update)
    before: torch.Tensor  # their values before the step
    counts: torch.Tensor  # bool: the step must move this element


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_pending: weakref.WeakKeyDictionary[Optimizer, tuple[int, list[_Sample]]] = weakref.WeakKeyDictionary()


def _lr(group: dict[str, Any]) -> float | None:
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        if not lr.is_cpu or lr.numel() != 1:
            return None  # reading it would wait for the device
        lr = lr.item()
    return float(lr) if isinstance(lr, (int, float)) else None


def _strided(t: torch.Tensor) -> torch.Tensor | None:
    if type(t) not in _PLAIN:
        return None  # a tensor subclass (FSDP2's DTensor): its elements are not all here
    if t.layout is not torch.strided or not t.is_contiguous() or t.numel() == 0 or not t.is_floating_point():
        return None
    flat = t.detach().view(-1)
    return flat[:: max(1, flat.numel() // _K)][:_K]


def _unrectified(grad: torch.Tensor, lr: float, group: dict[str, Any], state: Any) -> torch.Tensor | None:
    """RAdam's update size on a step it does not rectify (its first ~5 with the default betas): SGD with momentum,
    ``lr * |m̂|`` where ``m̂`` is the bias-corrected average of the gradients including this one. None on a rectified
    step (then it is adaptive, ``lr`` per element), or when the state cannot be read without waiting for a device."""
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    state = state if isinstance(state, dict) else {}
    step = state.get("step", 0)
    if isinstance(step, torch.Tensor):
        if not step.is_cpu:
            return None
        step = step.item()
    step = float(step) + 1
    rho_inf = 2 / (1 - beta2) - 1
    if rho_inf - 2 * step * beta2 ** step / (1 - beta2 ** step) > 5:
        return None
    average = grad.float() * (1 - beta1)
    exp_avg = state.get("exp_avg")
    previous = _strided(exp_avg) if isinstance(exp_avg, torch.Tensor) else None
    if previous is not None and previous.shape == grad.shape:
        average = average + beta1 * previous.float()
    return lr * average.abs() / (1 - beta1 ** step)


def _sample(p: torch.Tensor, lr: float, kind: type, group: dict[str, Any], state: Any = None) -> _Sample | None:
    g = p.grad
    if g is None or g.is_sparse or g.shape != p.shape:
        return None
    view, grad = _strided(p), _strided(g)
    if view is None or grad is None or grad.shape != view.shape:
        return None
    size = grad.abs().float()
    unrectified = _unrectified(grad, lr, group, state) if kind is torch.optim.RAdam else None
    if unrectified is not None:
        size = unrectified
    elif kind in _SGD_LIKE:
        size = size * lr
    elif kind in _ADADELTA:
        eps = float(group.get("eps", 1e-6))
        size = lr * eps ** 0.5 * size / (size * size + eps).sqrt()
    else:
        size = torch.full_like(size, lr)
    before = view.clone()
    ulp = torch.finfo(view.dtype).eps * before.abs().float().clamp_min(torch.finfo(view.dtype).tiny)
    counts = (grad != 0) & grad.isfinite() & before.isfinite() & (size > _ULPS * ulp)
    return _Sample(view, before, counts)


def _before(optimizer: Optimizer, look: int, caller: FrameType, more: bool) -> None:
    try:
        _pending.pop(optimizer, None)
        kind = type(optimizer)
        if kind not in _SGD_LIKE and kind not in _ADAPTIVE and kind not in _ADADELTA:
            return
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return  # a fused step handed GradScaler's found_inf may skip the update on purpose
        samples: list[_Sample] = []
        for group in optimizer.param_groups:
            lr = _lr(group)
            if not lr or lr <= 0 or group.get("maximize") or group.get("differentiable"):
                continue
            for p in group["params"]:
                sample = _sample(p, lr, kind, group, optimizer.state.get(p))
                if sample is not None:
                    samples.append(sample)
                    if len(samples) == _PARAMS:
                        _pending[optimizer] = (look, samples)
                        return
        if samples:
            _pending[optimizer] = (look, samples)
    except Exception as exc:
        internal_error(CODE, exc)


def _after(optimizer: Optimizer, look: int, caller: FrameType) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        entry = _pending.pop(optimizer, None)
        if entry is None or entry[0] != look:
            return
        counts = torch.stack([s.counts.any() for s in entry[1]]).any()
        moved = torch.stack([((s.param != s.before) & s.counts).any() for s in entry[1]]).any()
        frame = user_frame(caller)
        if frame is not None:
            _deferred.check(counts & ~moved, _decided, (Spot(frame), type(optimizer).__name__), CODE)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _decided(unchanged: Any, payload: tuple[Spot, str]) -> None:
    if unchanged:
        spot, kind = payload
        name = method_call(spot, "step", 0)[0] or "optimizer"
        report_at(CODE, spot.f_code.co_filename, spot.f_lineno, spot.f_globals, lambda: _message(name, kind))


def _message(name: str, kind: str) -> str:
    return (f"{CODE} {name}.step() changed nothing: the parameters it holds have finite, non-zero gradients and a "
            f"learning rate above 0, yet every sampled element is exactly what it was before the step. The {kind} "
            f"updates tensors that no longer hold the model's weights, or something puts the old values back right "
            f"after the step: a wrapper that swaps or restores parameters (master weights copied over the update, "
            f"FSDP/DeepSpeed wrapping after the optimizer was built). Build the optimizer last, over the parameters "
            f"the wrapped model uses: model = wrap(model); {name} = {kind}(model.parameters(), ...)")


def install(registry: Registry) -> None:
    _steps.listen(CODE, _before, after=_after)


def uninstall() -> None:
    _steps.unlisten(CODE)
    _deferred.clear(CODE)
    _pending.clear()
