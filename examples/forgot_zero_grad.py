"""Karpathy's "forgot to zero_grad": run with `python -m safetorch examples/forgot_zero_grad.py` (ST011)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
for _step in range(20):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
print(f"loss after 20 steps: {loss.item():.3f}")
