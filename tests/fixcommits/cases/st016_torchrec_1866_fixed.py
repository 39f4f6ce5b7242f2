"""ST016 — meta-pytorch/torchrec#1866 (https://github.com/meta-pytorch/torchrec/pull/1866), "Wrap DP tables with
DDP after reset parameters": data-parallel embedding tables are replicated on every rank and wrapped with
DistributedDataParallel, whose construction broadcasts rank 0's parameters; but the model's `reset_parameters()` ran
after the wrapping, and without the same manual seed on every rank it re-initialised each rank's replica
differently. DDP then averages the gradients of tables that are no longer the same ("the parameters are the same,
but not synced"). The fix delays the DDP wrapping to `reset_parameters()` and rewraps every time it is called. The
rule reports the first optimizer step whose replicas differ, on rank 0.

A 2-rank gloo job: run with `python -m torch.distributed.run --standalone --nproc-per-node 2`."""
# ranks: 2
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class EmbeddingBagCollection(nn.Module):
    def __init__(self, num_embeddings=64, dim=8, tables=2):
        super().__init__()
        self.embedding_bags = nn.ModuleList(nn.EmbeddingBag(num_embeddings, dim, mode="sum") for _ in range(tables))

    def reset_parameters(self):
        for ebc in self.embedding_bags:
            ebc.reset_parameters()

    def forward(self, ids, offsets):
        return torch.cat([ebc(ids, offsets) for ebc in self.embedding_bags], dim=1)


class DataParallelTables(nn.Module):
    """The data-parallel lookup of the sharded model: the tables, replicated and wrapped with DDP."""

    def __init__(self, ebc):
        super().__init__()
        self._ebc = ebc
        self._dp = DDP(ebc)

    def reset_parameters(self):
        self._ebc.reset_parameters()
        self._dp = DDP(self._ebc)  # rewrapped: DDP's construction broadcasts rank 0's fresh parameters

    def forward(self, ids, offsets):
        return self._dp(ids, offsets)


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
tables = DataParallelTables(EmbeddingBagCollection())
torch.manual_seed(1000 + rank)  # each rank's random state: its data, its dropout
tables.reset_parameters()
head = nn.Linear(16, 1)
opt = torch.optim.SGD(list(tables.parameters()) + list(head.parameters()), lr=0.1)

for _step in range(6):
    ids = torch.randint(0, 64, (24,))
    offsets = torch.arange(0, 24, 3)
    loss = (head(tables(ids, offsets)) - 1).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

dist.destroy_process_group()
