"""The models the benchmarks run: small enough for a CPU, shaped like the real thing."""

from __future__ import annotations

import torch
import torch.nn as nn


def small_cnn(channels: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, 10),
    )


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def resnet_like(width: int = 64, blocks: int = 4) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         *[_Block(width) for _ in range(blocks)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, 10))


def small_transformer(d_model: int = 256, layers: int = 4) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Flatten(1),
                         nn.LazyLinear(10))


class _Basic(nn.Module):
    """ResNet's basic block, with its projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.down(x))


def resnet18_like(width: int = 16) -> nn.Module:
    """ResNet-18's layout (stem, four stages of two basic blocks, 20 BatchNorm layers) at a CPU-sized width."""
    widths = [width, 2 * width, 4 * width, 8 * width]
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, w in enumerate(widths):
        layers += [_Basic(cin, w, 1 if i == 0 else 2), _Basic(w, w, 1)]
        cin = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def freeze_batchnorm(model: nn.Module) -> None:
    """What fine-tuning code does after ``model.train()``: every BatchNorm keeps its running statistics."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
