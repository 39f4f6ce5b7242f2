"""Loss modules that normalise a summed dense-prediction loss by the spatial size: ``HWNormalizedLoss``."""

from __future__ import annotations

from typing import Any

import torch

from ._hw import check_by, divisor

__all__ = ["HWNormalizedLoss"]


class HWNormalizedLoss(torch.nn.Module):
    """A loss module whose value is ``criterion``'s **sum** over all elements divided by the input's spatial size.

    The spatial size is the product of every dimension after (N, C): L for 1-D, H×W for 2-D, D×H×W for 3-D inputs,
    read from each input, so it stays right when the image size changes. ``by="nhw"`` also divides by the batch
    size N. This replaces ``criterion(score, target) / (128 * 128)`` with the size hard-coded::

        criterion = HWNormalizedLoss(nn.CrossEntropyLoss(reduction="sum"))
        loss = criterion(score, target)          # sum over pixels / (H * W)

    The criterion must not average already: ``reduction='sum'`` is used as is, ``reduction='none'`` is summed here,
    and ``'mean'``/``'batchmean'`` raise ``ValueError`` (it would normalise twice). The criterion is a submodule:
    its buffers (class ``weight``) are in this module's ``state_dict`` and move with ``.to()``.
    """

    def __init__(self, criterion: torch.nn.Module, by: str = "hw") -> None:
        super().__init__()
        reduction = getattr(criterion, "reduction", None)
        name = type(criterion).__name__
        if reduction in ("mean", "batchmean", "elementwise_mean"):
            raise ValueError(
                f"HWNormalizedLoss needs the sum of {name}, but it averages already (reduction={reduction!r}): the "
                f"loss would be normalised twice. Write: HWNormalizedLoss({name}(reduction='sum'), by={by!r})")
        if reduction not in ("sum", "none"):
            raise ValueError(f"HWNormalizedLoss needs a loss module with reduction='sum' or 'none'; {name} has "
                             f"reduction={reduction!r}")
        self.criterion = criterion
        self.by = check_by(by)

    def forward(self, input: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        n = divisor(input, self.by)
        value = self.criterion(input, target, *args, **kwargs)
        if self.criterion.reduction == "none":
            value = value.sum()
        return value / n

    def extra_repr(self) -> str:
        return f"by={self.by!r}"
