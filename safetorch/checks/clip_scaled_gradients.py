"""ST012: gradient clipping on AMP-scaled gradients, before ``scaler.unscale_(optimizer)``.

With a ``GradScaler`` the gradients that ``scaler.scale(loss).backward()`` leaves are multiplied by the scale
(65536 at the start): ``clip_grad_norm_(params, 1.0)`` then compares a norm 65536 times too large with 1.0 and
shrinks every gradient, or ``clip_grad_value_`` clips scaled values — training crawls, nothing fails. AMP's recipe:
``scaler.unscale_(optimizer)`` first, then clip.

``GradScaler.scale`` and ``GradScaler.update`` are wrapped to know which enabled scalers have scaled a loss since
their last update; ``clip_grad_norm_`` and ``clip_grad_value_`` (in ``torch.nn.utils`` and
``torch.nn.utils.clip_grad``) look at those scalers only: one whose ``unscale_`` (or ``step``) ran for no optimizer
since means the gradients are still scaled. Silent: ``unscale_`` first; a disabled scaler (``enabled=False``); bf16
autocast without a scaler; clipping outside a scaled step; a limit scaled on purpose (``max_norm *
scaler.get_scale()``: a limit at least a sixteenth of the scale); clipping parameters that no scaled loss reached (an
fp32 critic's own gradients while the actor's loss is scaled: the first `_WALKS` scaled losses of each scaler are
walked, for the parameters they reach). A program with several optimizers that unscales one and
clips another's gradients is not seen (the scaler has unscaled something). Cost: nothing without a GradScaler; with
one, a wrapper on two calls per step and a look at a dict at each clip; on an accelerator the scale is compared with
the limit on the device and read through `safetorch._deferred` (the finding comes at a later backward, at the clip's
line), never with ``get_scale()``, which would make the host wait for the device.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch.nn.utils
import torch.nn.utils.clip_grad

from .. import _deferred
from .._callsite import Spot, quoted_call
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, report_at, user_frame
from .._rule import Rule

try:
    from torch.amp import GradScaler
except ImportError:  # torch < 2.3
    from torch.cuda.amp import GradScaler

CODE = "ST012"


class ClipScaledGradientsWarning(SafetorchWarning):
    """ST012: gradients clipped while still multiplied by a GradScaler's scale (``unscale_`` missing)."""

    code = "ST012"


RULE = Rule("ST012", "clip-scaled-gradients", ClipScaledGradientsWarning,
            "gradient clipping on AMP-scaled gradients before scaler.unscale_")

_scaled: weakref.WeakSet[Any] = weakref.WeakSet()  # enabled scalers that scaled a loss since their last update()
#: Per scaler: the parameters (by id) its first scaled losses reached, and how many losses were walked for them.
_reached: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_WALKS = 8
_NODES = 100_000  # a walk that meets more autograd nodes knows nothing: every clip is then looked at


def _scale(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        if instance.is_enabled():
            _scaled.add(instance)
            entry = _reached.setdefault(instance, [set(), 0])
            if entry[1] < _WALKS and entry[0] is not None:
                entry[1] += 1
                entry[0] = _leaves(args[0] if args else kwargs.get("outputs"), entry[0])
    except Exception as exc:
        internal_error(CODE, exc)
    return wrapped(*args, **kwargs)


def _leaves(outputs: Any, found: set[int]) -> set[int] | None:
    """The ids of the leaf tensors (parameters) the outputs' graph reaches, added to ``found``; None: too large."""
    tensors = [outputs] if isinstance(outputs, torch.Tensor) else [t for t in (outputs or ()) if
                                                                    isinstance(t, torch.Tensor)]
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        if len(seen) > _NODES:
            return None
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return found


def _limit(function: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | torch.Tensor | None:
    """The clip's limit: a number, a 0-dim tensor (not read here: it may live on the device), or None."""
    value = args[1] if len(args) > 1 else kwargs.get("max_norm" if function == "clip_grad_norm_" else "clip_value")
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()) if value.numel() == 1 else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _reaches(scaler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this clip is of parameters the scaler's losses reached (True when that is not known)."""
    entry = _reached.get(scaler)
    reached = entry[0] if entry is not None else None
    if not reached:
        return True  # nothing known: look at every clip, as before
    params = args[0] if args else kwargs.get("parameters")  # a list by now (the wrapper read a generator once)
    params = [params] if isinstance(params, torch.Tensor) else (params or [])
    return any(id(p) in reached for p in params)


def _decide(scaler: Any, limit: float | torch.Tensor | None, function: str, spot: Spot) -> None:
    """Compare the limit with the scale, a tensor on the scaler's device, through `safetorch._deferred`: read at once
    on the CPU, once the device has computed it on an accelerator (``get_scale()`` would make the host wait). A
    tensor limit travels with the scale (the pair is read together)."""
    scale = scaler._scale.detach().reshape(())
    if isinstance(limit, torch.Tensor):
        value = torch.stack((scale, limit.to(device=scale.device, dtype=scale.dtype)))
        _deferred.check(value, _decided, (function, spot, None), CODE)
    else:
        _deferred.check(scale, _decided, (function, spot, limit), CODE)


def _decided(value: Any, payload: tuple[str, Spot, float | None]) -> None:
    function, spot, limit = payload
    scale, limit = value if isinstance(value, list) else (value, limit)
    if limit is not None and limit * 16 >= scale:
        return  # `max_norm * scaler.get_scale()`: a limit on the scaled gradients, on purpose
    report_at(CODE, spot.f_code.co_filename, spot.f_lineno, spot.f_globals,
              lambda: _message(function, scale, quoted_call(spot, f"{function}(...)")))


def _update(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _scaled.discard(instance)
    return wrapped(*args, **kwargs)


def _still_scaled(scaler: Any) -> bool:
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None or getattr(scaler, "_scale", None) is None:
        return False
    return not any(getattr(s.get("stage"), "name", "READY") != "READY" for s in states.values())


def _message(function: str, scale: float, shown: str) -> str:
    what = ("compares a gradient norm that many times too large with max_norm, and shrinks every gradient"
            if function == "clip_grad_norm_" else "clips gradient values that are that many times too large")
    return (f"{CODE} {shown} clips gradients still multiplied by the GradScaler's scale ({scale:g}): it {what}; "
            f"training crawls. Call scaler.unscale_(optimizer) before clipping (scaler.step() then does not "
            f"unscale again)")


def _look(function: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A clip while a scaler has scaled a loss: is it of still-scaled gradients? Returns the arguments to call torch
    with (a generator of parameters is read once, into a list)."""
    __tracebackhide__ = True  # noqa: F841
    try:
        params = args[0] if args else kwargs.get("parameters")
        if params is not None and not isinstance(params, torch.Tensor):  # read a generator once
            params = list(params)
            args, kwargs = ((params, *args[1:]), kwargs) if args else (args, {**kwargs, "parameters": params})
        scaler = next((s for s in list(_scaled) if _still_scaled(s) and _reaches(s, args, kwargs)), None)
        if scaler is not None:
            frame = user_frame(sys._getframe(2))
            if frame is not None:
                _decide(scaler, _limit(function, args, kwargs), function, Spot(frame))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)
    return args, kwargs


def _clip(function: str) -> Any:
    """``clip_grad_norm_``/``clip_grad_value_``: a plain function (see `Registry.replace`), which without a scaler
    that has scaled a loss pays one test of a set."""

    def factory(original: Any) -> Any:
        def clip(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            if _scaled:
                args, kwargs = _look(function, args, kwargs)
            return original(*args, **kwargs)

        return clip

    return factory


def install(registry: Registry) -> None:
    registry.wrap(GradScaler, "scale", _scale, CODE)
    registry.wrap(GradScaler, "update", _update, CODE)
    for function in ("clip_grad_norm_", "clip_grad_value_"):
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            registry.replace(owner, function, _clip(function), CODE)


def uninstall() -> None:
    _deferred.clear(CODE)
    _scaled.clear()
    _reached.clear()
