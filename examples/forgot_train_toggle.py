"""Karpathy's "forgot to toggle train/eval mode": `python -m safetorch examples/forgot_train_toggle.py` (ST003, ST008).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
for epoch in range(3):
    for _step in range(5):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    model.eval()
    accuracy = (model(x).argmax(1) == y).float().mean()  # validation without torch.no_grad()
    print(f"epoch {epoch}: loss {loss.item():.3f}, accuracy {accuracy.item():.2f}")
    # model.train() forgotten: the next epoch trains with dropout off and BatchNorm frozen
