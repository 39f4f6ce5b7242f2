"""ST004 — bubbliiiing/faster-rcnn-pytorch#35 (https://github.com/bubbliiiing/faster-rcnn-pytorch/issues/35), fixed
by the author: fit_one_epoch summed its losses with `total_loss += total` (and the rpn/roi parts likewise), keeping
each step's graph alive and memory growing; the fix sums `.item()`."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 6))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)


def fit_one_epoch(epoch_step):
    total_loss = 0
    rpn_loc_loss = 0
    for _ in range(epoch_step):
        out = model(torch.randn(4, 16))
        rpn_loc, roi_cls = out[:, :4].pow(2).mean(), out[:, 4:].abs().mean()
        total = rpn_loc + roi_cls
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        total_loss += total  # ST004: keeps every step's graph
        rpn_loc_loss += rpn_loc.item()
    return total_loss / epoch_step, rpn_loc_loss / epoch_step


fit_one_epoch(6)
