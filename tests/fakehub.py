"""A stand-in for a model hub (transformers' ``from_pretrained``): a library function, outside the tests, that
returns its model in eval mode, as transformers does. Its line numbers are asserted by the tests: keep them."""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def from_pretrained(seed: int = 0) -> TinyClassifier:
    torch.manual_seed(seed)
    model = TinyClassifier()
    model.eval()  # EVAL_LINE: what transformers does after loading the weights
    return model


EVAL_LINE = 23


class FrozenBackboneNet(nn.Module):
    """A module whose __init__ puts its backbone in eval mode; a plain loop then trains the whole net."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = from_pretrained().encoder
        self.backbone.eval()
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class OwnState(nn.Module):
    """A module whose own __getstate__ copies its __dict__ without calling Module.__getstate__."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def __getstate__(self) -> dict[str, object]:
        return self.__dict__.copy()
