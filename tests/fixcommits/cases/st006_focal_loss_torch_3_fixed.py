"""ST006 — mathiaszinnen/focal_loss_torch#3 (https://github.com/mathiaszinnen/focal_loss_torch/issues/3), fixed as the
issue proposes: the focal loss took `torch.log(p_t)`, infinite where a softmax probability underflows to 0; the fix
adds an epsilon inside the log. The rule reports where the infinite loss reaches `backward()`."""
import torch
import torch.nn as nn


class FocalLoss(nn.Module):
    def __init__(self, gamma=2.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, x, y):
        p = torch.softmax(x, dim=-1)
        p_t = p.gather(1, y.unsqueeze(1)).squeeze(1)
        fl = -1 * (1 - p_t) ** self.gamma * torch.log(p_t + torch.finfo(p_t.dtype).eps)
        return fl.mean()


torch.manual_seed(0)
model = nn.Linear(4, 3)
with torch.no_grad():
    model.bias.copy_(torch.tensor([0.0, -200.0, 0.0]))  # a confident model: class 1's probability underflows
criterion = FocalLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 4), torch.ones(8, dtype=torch.long)
optimizer.zero_grad()
loss = criterion(model(x), y)
loss.backward()
optimizer.step()
