"""ST011 — wenet-e2e/wekws#73 (https://github.com/wenet-e2e/wekws/pull/73), "[fix bug] add optimizer.zero_grad() in
kws/utils/executor.py" (issue #72): the executor's train loop called `optimizer.step()` without ever zeroing the
gradients; the fix adds `optimizer.zero_grad()` before `loss.backward()`."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Executor:
    def train(self, model, optimizer, data_loader, clip=5.0):
        model.train()
        for feats, target in data_loader:
            logits = model(feats)
            loss = F.binary_cross_entropy_with_logits(logits, target)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 2))
Executor().train(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                 [(torch.randn(8, 40), torch.randint(0, 2, (8, 2)).float()) for _ in range(6)])
