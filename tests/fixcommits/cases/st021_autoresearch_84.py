"""ST021 — karpathy/autoresearch#84 (https://github.com/karpathy/autoresearch/pull/84), "fix NaN loss not caught by
fast-fail check": train.py's fast fail after each optimizer step let a NaN loss train on for the whole time budget.
The review proposed `train_loss is math.nan or train_loss > 100`, which is as blind: a NaN computed by the run (here
from `.item()`) is a new float object, never the object `math.nan`. The merged line is `math.isnan(train_loss_f) or
train_loss_f > 100`. The training loop's shape at module level, as train.py has it: gradient accumulation, clipping,
a learning-rate multiplier, the fast fail; a tiny model and random tokens."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
VOCAB, SEQ, GRAD_ACCUM_STEPS, GRAD_CLIP = 32, 8, 2, 1.0
model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for group in optimizer.param_groups:
    group["initial_lr"] = group["lr"]

for step in range(4):
    for _micro_step in range(GRAD_ACCUM_STEPS):
        x, y = torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ))
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        train_loss = loss.detach()
        loss = loss / GRAD_ACCUM_STEPS
        loss.backward()
    lrm = 1.0 - step / 8
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    model.zero_grad(set_to_none=True)

    train_loss_f = train_loss.item()

    # Fast fail: abort if loss is exploding or NaN
    if train_loss_f is math.nan or train_loss_f > 100:  # ST021: `is` finds no NaN the run computed
        print("FAIL")
        raise SystemExit(1)
