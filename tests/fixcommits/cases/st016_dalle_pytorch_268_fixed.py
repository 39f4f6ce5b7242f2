"""ST016 — lucidrains/DALLE-pytorch#268 (https://github.com/lucidrains/DALLE-pytorch/issues/268): `train_dalle.py`
steps its `ReduceLROnPlateau` at the end of each epoch with `distr_scheduler.step(loss)`, the last batch's loss of
the rank's own shard, although the loop already computes `avg_loss = distr_backend.average_all(loss)`; each rank's
scheduler sees another loss, so one rank lowers its learning rate while the other does not ("the learning rate for
each process is not synchronized"), and from then on the ranks apply different updates to what should be one model.
The fix, suggested by the maintainers in the issue, steps the scheduler with `avg_loss` (`distr_scheduler.step(
avg_loss)` in later revisions of `train_dalle.py`). The rule reports the first optimizer step whose replicas already
differ, on rank 0; the line the fix changed is the scheduler's.

A 2-rank gloo job: run with `python -m torch.distributed.run --standalone --nproc-per-node 2`."""
# ranks: 2
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def average_all(t):
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
dalle = nn.Sequential(nn.Embedding(32, 16), nn.Flatten(), nn.Linear(16 * 6, 32))
distr_dalle = DDP(dalle)
opt = torch.optim.Adam(distr_dalle.parameters(), lr=3e-3)
distr_scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, cooldown=0)

g = torch.Generator().manual_seed(100 + rank)  # each rank draws its own batches (its shard of the data)

for _epoch in range(4):
    shard = [(torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 32, (8,), generator=g)) for _ in range(2)]
    for text, images in shard:
        loss = F.cross_entropy(distr_dalle(text), images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg_loss = average_all(loss)
    distr_scheduler.step(avg_loss)

dist.destroy_process_group()
