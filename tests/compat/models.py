"""Models the compatibility tests share: ordinary ones, and one that calls every API safetorch wraps."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.1),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class EveryAPI(nn.Module):
    """Uses, correctly, each wrapped API that can run inside a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.criterion = nn.MSELoss(reduction="sum")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x.double().float().contiguous().clone())
        y = 1.0 + y.to(torch.float32)
        z = y.detach().half().float() + y.to(torch.bfloat16).float() * 0
        return self.criterion(y, z) + F.l1_loss(y, z) + F.cross_entropy(y, z.softmax(-1))


def inputs() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    return {
        "convnet": (convnet(), torch.randn(2, 3, 8, 8)),
        "transformer": (transformer(), torch.randn(2, 5, 32)),
        "every_api": (EveryAPI(), torch.randn(4, 8)),
        "eval_convnet": (convnet().eval(), torch.randn(2, 3, 8, 8)),
    }
