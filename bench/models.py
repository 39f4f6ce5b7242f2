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


def tiny_mlp(dropout: float = 0.0) -> nn.Module:
    """16 -> 32 -> 10; with ``dropout``, a Dropout layer after the ReLU (a model ST019 follows in training mode)."""
    if dropout:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 10))
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


class _GPT2Block(nn.Module):
    """GPT-2's block: pre-LayerNorm attention and MLP, each with its residual dropout."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)
        self.mlp_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.shape[-1] ** 0.5))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = self.attn_dropout(att.softmax(dim=-1)) @ v
        x = x + self.resid_dropout(self.attn_proj(y.transpose(1, 2).reshape(b, t, c)))
        hidden = torch.nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp_dropout(self.mlp_proj(hidden))


class GPT2(nn.Module):
    """GPT-2's layout (small: 12 layers, 768 wide, 12 heads, 50257 tokens, 124M parameters), tied embeddings."""

    def __init__(self, n_layer: int = 12, n_embd: int = 768, n_head: int = 12, vocab: int = 50257,
                 ctx: int = 1024, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(ctx, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(_GPT2Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + self.down(x))


def resnet50(classes: int = 1000, width: int = 64) -> nn.Module:
    """ResNet-50's layout (bottleneck blocks 3-4-6-3; 25.6M parameters at width 64)."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, blocks in enumerate((3, 4, 6, 3)):
        w = width * 2 ** i
        for j in range(blocks):
            layers.append(_Bottleneck(cin, w, 2 if j == 0 and i > 0 else 1))
            cin = w * _Bottleneck.expansion
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))
