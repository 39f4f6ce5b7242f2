"""ST010: ``optimizer.step()`` while no parameter the optimizer holds has a gradient: the step updates nothing.

The causes seen in real code: the optimizer holds only frozen parameters (built before freezing, or over the wrong
module: the TrainCheck paper's Adadelta over a frozen classifier head), it was built over tensors the loss does not
use (a copy of the model, parameters re-created after the optimizer was built), or ``zero_grad()`` runs between
``backward()`` and ``step()``. Looked at in the shared step pre-hook (`safetorch._steps`: an optimizer's first steps,
then a sample); the scan stops at the first parameter with a gradient, which is the first one in a working loop.
Silent: ``step(closure)``, and any step where one parameter of any group has a gradient (MoE experts that got none
this step).
"""

from __future__ import annotations

from types import FrameType

from torch.optim import Optimizer

from .. import _steps
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error
from .._rule import Rule

CODE = "ST010"


class StepWithoutGradientsWarning(SafetorchWarning):
    """ST010: ``optimizer.step()`` while none of the optimizer's parameters has a gradient."""

    code = "ST010"


RULE = Rule("ST010", "step-without-gradients", StepWithoutGradientsWarning,
            "optimizer.step() while none of its parameters has a gradient", sampled=True)


def _message(optimizer: Optimizer, name: str) -> str:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    frozen = sum(not p.requires_grad for p in params)
    kind = type(optimizer).__name__
    head = f"{CODE} {name}.step() updates nothing: none of the {len(params)} parameters {kind} holds has a gradient"
    if frozen == len(params):
        return (f"{head}; every one is frozen (requires_grad=False). Build the optimizer over what you train, "
                f"after freezing: {kind}((p for p in model.parameters() if p.requires_grad), ...)")
    return (f"{head}. Either backward() did not reach them — the optimizer was built over other tensors than the "
            f"loss uses (a copy of the model, parameters replaced after {kind}(...) was built: build it after "
            f"model.to(device), any re-initialisation and any wrapping that replaces them: fully_shard/FSDP) — or "
            f"zero_grad() runs between loss.backward() and "
            f"{name}.step(): zero the gradients before backward(), or after step()")


def _look(optimizer: Optimizer, step: int, caller: FrameType, more: bool) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        empty = True
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    return
                empty = False
        if empty:
            return
        _steps.report_step(CODE, caller, lambda name: _message(optimizer, name))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def install(registry: Registry) -> None:
    _steps.listen(CODE, _look)


def uninstall() -> None:
    _steps.unlisten(CODE)
