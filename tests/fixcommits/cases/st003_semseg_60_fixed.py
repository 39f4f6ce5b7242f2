"""ST003 — hszhao/semseg#60 (https://github.com/hszhao/semseg/issues/60), '"out of memory" during validation':
tool/train.py's validate() put the model in eval mode and ran `output = model(input)` with autograd on; the fix the
issue gives wraps the forward in `torch.no_grad()`."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def validate(val_loader, model, criterion):
    model.eval()
    loss_sum = 0.0
    for input, target in val_loader:
        with torch.no_grad():
            output = model(input)
        loss_sum += criterion(output, target).item()
    return loss_sum / len(val_loader)


torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _epoch in range(2):
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(2, 3, 8, 8)), torch.randint(0, 4, (2, 8, 8))).backward()
        optimizer.step()
    validate([(torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2, 8, 8))) for _ in range(4)], model,
             nn.CrossEntropyLoss())
