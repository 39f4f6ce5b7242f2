"""Numbers unchanged: a deterministic training run of a few epochs gives bit-identical weights with safetorch on
and off (the parity rule of Lightning's tests)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import safetorch

from .models import convnet


def _train() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = convnet()
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    total = 0.0
    for _epoch in range(3):
        model.train()
        for x, y in loader:
            loss = criterion(model(x.float()), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            for x, y in loader:
                total += criterion(model(x), y).item()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["_total"] = torch.tensor(total, dtype=torch.float64)
    return state


def test_weights_are_bit_identical_with_safetorch_on_and_off() -> None:
    safetorch.uninstall()
    off = _train()
    safetorch.install()
    on = _train()
    assert off.keys() == on.keys()
    for key in off:
        assert torch.equal(off[key], on[key]), key
