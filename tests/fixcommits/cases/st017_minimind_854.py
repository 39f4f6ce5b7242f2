"""ST017 — jingyaogong/minimind#854 (https://github.com/jingyaogong/minimind/pull/854), "route RL trainer forward
through DDP so gradients all-reduce": train_grpo.py wrapped the policy in DistributedDataParallel, then ran the
loss-bearing forward through `model.module`, so backward all-reduced nothing. (A gloo group of one process here.)"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(3):
            outputs, advantages = torch.randn(4, 8), torch.randn(4)
            model_unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
            res = model_unwrapped(outputs)  # ST017: bypasses DDP: no all-reduce
            loss = -(res.log_softmax(-1)[:, 0] * advantages).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        dist.destroy_process_group()
