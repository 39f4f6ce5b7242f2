"""ST017: a DistributedDataParallel wrapper bypassed: its inner module trained through its own forward, or its
parameters moved or cast after wrapping. Either way DDP no longer averages the gradients and every rank trains a
model of its own, silently (pytorch/pytorch#104336; a loop that calls ``model`` on some steps and ``DDP(model)`` on
others).

How it is seen (`safetorch._ddp` records each wrapper and knows when its forward runs):
- *the bare forward*: a forward pre-hook on the wrapped module notes a forward that does not run through the wrapper,
  with autograd on, outside ``no_sync()`` (there the gradients stay local on purpose, and are averaged at the next
  synchronised backward), while its parameters require grad; a hook on that forward's output then reports when a
  backward passes through it and is going to accumulate into the module's parameters (``torch.autograd.grad`` with
  respect to the inputs, for a saliency map, accumulates nothing: silent). Reported at the forward's line.
  Evaluation through ``model.module`` under ``no_grad``, ``model.module`` read for saving or an EMA: silent.
- *the move*: ``nn.Module._apply`` (what ``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.double()`` … call) on a
  module that holds parameters a live wrapper holds, when a parameter's device or dtype changed (``model.to(device)``
  on a model already there changes nothing: silent). Reported at the moving call's line. Moving before wrapping:
  nothing to see.

The hooks are module-level functions (a module holding them still pickles and deep-copies); only wrapped modules get
them, and they go with the wrapper.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.hooks import unserializable_hook

from .. import _ddp
from .._callsite import Spot, quoted_call
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._hooks import untallied
from .._patch import Registry
from .._report import internal_error, report, report_at, user_frame
from .._rule import Rule

CODE = "ST017"


class DdpBypassedWarning(SafetorchWarning):
    """ST017: a DDP-wrapped module trained through its bare forward, or moved/cast after wrapping."""

    code = "ST017"


RULE = Rule("ST017", "ddp-bypassed", DdpBypassedWarning,
            "a DDP-wrapped module trained through its bare forward, or moved/cast after wrapping")

_applying = [0]  # depth of _apply calls in progress (their recursion into children is one move)


def _first_trained(module: torch.nn.Module) -> torch.Tensor | None:
    return next((p for p in module.parameters() if p.requires_grad), None)


def _accumulator(p: torch.Tensor) -> Any:
    """The parameter's AccumulateGrad node (the one every graph uses while it is alive)."""
    with torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


def _bare_pre(module: torch.nn.Module, args: Any) -> None:
    entry = _ddp.inner.get(id(module))
    if entry is None or entry.depth or not torch.is_grad_enabled() or is_compiling():
        return
    try:
        ddp = entry.ddp()
        if ddp is None or not ddp.require_backward_grad_sync:
            return
        p = _first_trained(module)
        frame = user_frame(sys._getframe(1)) if p is not None else None
        if frame is not None:
            entry.state[CODE] = (Spot(frame), _accumulator(p))
    except Exception as exc:
        internal_error(CODE, exc)


def _first_graph_tensor(value: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if depth > 3:
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _first_graph_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


def _bare_post(module: torch.nn.Module, args: Any, output: Any) -> None:
    entry = _ddp.inner.get(id(module))
    if entry is None:
        return
    noted = entry.state.pop(CODE, None)
    if noted is None or entry.depth:
        return
    try:
        out = _first_graph_tensor(output)
        if out is None:
            return
        spot, accumulator = noted

        @unserializable_hook  # the output still saves (torch.save) without it, and without a warning
        def hook(grad: torch.Tensor) -> None:
            _reached(spot, accumulator)

        untallied(out.register_hook, hook)
    except Exception as exc:
        internal_error(CODE, exc)


def _reached(spot: Spot, accumulator: Any) -> None:
    """A backward passes through the bare forward's output: report when it will accumulate into the parameters."""
    __tracebackhide__ = True  # noqa: F841
    try:
        if not torch._C._will_engine_execute_node(accumulator):
            return
    except Exception:  # an older torch without the query: a backward through the output trains the module
        pass
    try:
        report_at(CODE, spot.f_code.co_filename, spot.f_lineno, spot.f_globals, lambda: _bypass_message(spot))
    except Exception as exc:
        internal_error(CODE, exc)


def _bypass_message(spot: Spot) -> str:
    call = quoted_call(spot, "this forward")  # type: ignore[arg-type]
    return (f"{CODE} {call} runs the module that DistributedDataParallel wraps through its own forward, and "
            f"backward() trains its parameters: DDP averages gradients only for forwards through the wrapper, so "
            f"these gradients stay local and the ranks drift apart. Call the wrapper: out = ddp_model(x) "
            f"(accumulating without synchronising on purpose: `with ddp_model.no_sync():`; evaluating: under "
            f"`torch.no_grad()`)")


def _layout(module: torch.nn.Module) -> list[tuple[torch.device, torch.dtype]]:
    return [(p.device, p.dtype) for p in module.parameters()]


def _apply(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not _ddp.live or _applying[0] or not isinstance(instance, torch.nn.Module):
        return wrapped(*args, **kwargs)
    try:
        held = bool(_ddp.holding(instance.parameters()))
        before = _layout(instance) if held else None
    except Exception as exc:
        internal_error(CODE, exc)
        before = None
    _applying[0] += 1
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _applying[0] -= 1
    if before is not None:
        __tracebackhide__ = True  # noqa: F841
        _moved(instance, before)
    return result


def _moved(module: torch.nn.Module, before: list[tuple[torch.device, torch.dtype]]) -> None:
    try:
        after = _layout(module)
        changed = next(((b, a) for b, a in zip(before, after, strict=False) if a != b), None)
        frame = user_frame(sys._getframe(1)) if changed is not None else None
    except Exception as exc:
        internal_error(CODE, exc)
        return
    if frame is not None and changed is not None:
        (device, dtype), (new_device, new_dtype) = changed
        what = f"from {device} to {new_device}" if device != new_device else f"from {dtype} to {new_dtype}"
        report(CODE, frame, lambda: _move_message(frame, what))


def _move_message(frame: Any, what: str) -> str:
    call = quoted_call(frame, "this call")
    return (f"{CODE} {call} moved parameters that DistributedDataParallel already wraps ({what}): DDP's reducer "
            f"keeps the gradient buckets it built at wrapping, so from here on the gradients are not averaged across "
            f"ranks and every rank trains its own model (pytorch/pytorch#104336). Move or cast the model first, "
            f"then wrap it: model.to(device); ddp_model = DDP(model, device_ids=[rank])")


def _new(entry: _ddp.Wrapped) -> None:
    module = entry.module()
    if module is not None:
        handles = (untallied(module.register_forward_pre_hook, _bare_pre),
                   untallied(module.register_forward_hook, _bare_post))
        entry.state[CODE + ":hooks"] = handles


def _gone(entry: _ddp.Wrapped) -> None:
    for handle in entry.state.pop(CODE + ":hooks", ()):
        handle.remove()


def install(registry: Registry) -> None:
    registry.wrap(torch.nn.Module, "_apply", _apply, CODE)
    _ddp.listen(CODE, _new, _gone)


def uninstall() -> None:
    for entry in list(_ddp.live.values()):
        _gone(entry)
        entry.state.pop(CODE, None)
    _ddp.unlisten(CODE)
