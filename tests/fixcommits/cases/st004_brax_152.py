"""ST004 — google/brax#152 (https://github.com/google/brax/pull/152), "Remove 'memory leak' in PyTorch training
example": the training loop summed `total_loss += loss` after each step, keeping every step's graph alive; the fix
sums `float(loss)`."""
import torch
import torch.nn as nn

torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)
total_loss = 0
for _ in range(6):
    obs, target = torch.randn(16, 8), torch.randn(16, 2)
    optimizer.zero_grad()
    loss = ((policy(obs) - target) ** 2).mean()
    loss.backward()
    optimizer.step()
    total_loss += loss  # ST004: keeps every step's graph
print(float(total_loss) / 6)
