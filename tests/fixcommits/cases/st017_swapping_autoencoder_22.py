"""ST017 — rosinality/swapping-autoencoder-pytorch#22 (https://github.com/rosinality/swapping-autoencoder-pytorch/issues/22),
"DDP training": train.py called the encoder through its `module` attribute; "Won't this prevent gradient
synchronization during backward?" — it does: the forward bypasses DistributedDataParallel. (A gloo group of one
process here.)"""
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
        encoder = DistributedDataParallel(nn.Sequential(nn.Linear(16, 8), nn.LeakyReLU(0.2)))
        generator = DistributedDataParallel(nn.Linear(8, 16))
        e_optim = torch.optim.Adam(list(encoder.parameters()) + list(generator.parameters()), lr=2e-3)
        for _ in range(3):
            real_img = torch.randn(4, 16)
            structure = encoder.module(real_img)  # ST017: bypasses DDP: no all-reduce
            fake_img = generator(structure)
            recon_loss = (fake_img - real_img).abs().mean()
            e_optim.zero_grad()
            recon_loss.backward()
            e_optim.step()
    finally:
        dist.destroy_process_group()
