"""ST011 — Hsintien-Ng/idinvert_pytorch-reproduced#1 (https://github.com/Hsintien-Ng/idinvert_pytorch-reproduced/issues/1),
"optimizer_D.zero_grad() missing?", fixed by the author: the discriminator's update in training_loop_encoder.py never
zeroed its gradients, so each step used the sum of every earlier step's."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
E = nn.Sequential(nn.Linear(16, 8))
D = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
G = nn.Linear(8, 16).requires_grad_(False)  # a fixed generator
optimizer_E = torch.optim.Adam(E.parameters(), lr=1e-4)
optimizer_D = torch.optim.Adam(D.parameters(), lr=1e-4)
for _ in range(6):
    real = torch.randn(4, 16)
    fake = G(E(real))
    loss_D = F.softplus(D(fake.detach())).mean() + F.softplus(-D(real)).mean()
    loss_D.backward()
    optimizer_D.step()  # ST011: zero_grad() never called for D
    optimizer_E.zero_grad()
    loss_E = F.mse_loss(fake, real) + F.softplus(-D(fake)).mean()
    loss_E.backward()
    optimizer_E.step()
