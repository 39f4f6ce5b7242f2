"""ST007 — batra-mlp-lab/visdial-challenge-starter-pytorch#34
(https://github.com/batra-mlp-lab/visdial-challenge-starter-pytorch/pull/34), "Code Speedup": train.py called
`torch.cuda.empty_cache()` after every batch; the fix calls it after every epoch instead."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()
for _epoch in range(2):
    for _ in range(12):
        optimizer.zero_grad()
        batch_loss = criterion(model(torch.randn(8, 32)), torch.randint(0, 10, (8,)))
        batch_loss.backward()
        optimizer.step()
        torch.cuda.empty_cache()  # ST007: after every batch
