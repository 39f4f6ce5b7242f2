"""A 2-rank gloo job on the CPU with each distributed bug of ST016-ST018 (and ST010/ST011/ST019 in DDP loops),
reproduced from their descriptions, and their correct versions. Run by tests/test_distributed.py under torchrun
(``python -m torch.distributed.run --nproc_per_node 2 [-m safetorch] distributed_job.py OUT``) and under ``mp.spawn``
(``python [-m safetorch] distributed_job.py OUT --spawn``), with safetorch and without it: the lines marked
``# expect: STxxx`` are the findings; the correct versions' weights, written to OUT by rank 0, must not depend on
safetorch. (This file is not collected by pytest: its name does not start with ``test_``.)"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

F = torch.nn.functional
rank = 0


def make(bn: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    if bn:
        layers.insert(1, torch.nn.BatchNorm1d(8))
    return torch.nn.Sequential(*layers)


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * i + rank)  # each rank its own batches
    return torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)


def weights(model: torch.nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)[:4]]


# --- the bugs -------------------------------------------------------------------------------------------------------
def diverging() -> torch.nn.Module:
    """BLOOM-style: from step 3 on, rank 0 clips with a norm only it computes; the replicas drift apart."""
    model = DDP(make())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(8):
        x, y = data(i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if i >= 2 and rank == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()  # expect: ST016
    return model


def alternating() -> torch.nn.Module:
    """The bare module on even steps, the wrapper on odd ones."""
    model = make()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for i in range(6):
        x, y = data(i)
        opt.zero_grad()
        out = model(x) if i % 2 == 0 else ddp(x)  # expect: ST017
        F.cross_entropy(out, y).backward()
        opt.step()  # expect: ST016 (the replicas diverged through the bare steps)
    return ddp


def moved() -> torch.nn.Module:
    """pytorch/pytorch#104336: the wrapper moved (here: cast) after wrapping."""
    ddp = DDP(make())
    ddp.double()  # expect: ST017
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for i in range(4):
        x, y = data(i)
        opt.zero_grad()
        F.cross_entropy(ddp(x.double()), y).backward()
        opt.step()  # expect: ST016 (the gradients are no longer averaged)
    return ddp


def restored() -> torch.nn.Module:
    """A wrapper that keeps master weights and writes them back after every step: no update survives."""
    model = DDP(make())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    master = [p.detach().clone() for p in model.parameters()]

    def put_back(*args: Any) -> None:
        with torch.no_grad():
            for p, m in zip(model.parameters(), master, strict=True):
                p.copy_(m)

    opt.register_step_post_hook(put_back)
    for i in range(3):
        x, y = data(i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()  # expect: ST018
    return model


def forgotten_zero_grad_with_no_sync() -> torch.nn.Module:
    """Accumulation over two micro-batches with no_sync(), clipping, and no zero_grad() anywhere."""
    model = DDP(make())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(4):
        x, y = data(i)
        with model.no_sync():
            F.cross_entropy(model(x[:4]), y[:4]).backward()
        F.cross_entropy(model(x[4:]), y[4:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # expect: ST011
    return model


def fsdp_after_optimizer() -> torch.nn.Module:
    """accelerate#2665's order: the optimizer built over the parameters that fully_shard then replaces."""
    from torch.distributed.fsdp import fully_shard

    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fully_shard(model)
    for i in range(2):
        x, y = data(i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()  # expect: ST010
    return model


def evaluated_in_train_mode() -> torch.nn.Module:
    """A validation loop with neither eval() nor no_grad: each rank's BatchNorm statistics take the batches in."""
    model = DDP(make(bn=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        x, y = data(i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    correct = 0
    for i in range(5):
        x, y = data(10 + i)
        correct += int((model(x).argmax(1) == y).sum())  # expect: ST019
    return model


# --- their correct versions: silent, the same weights with safetorch and without it ---------------------------------
def correct() -> list[float]:
    """Every rank clips the same (DDP averaged) gradients; evaluation through model.module under no_grad; an EMA and
    a checkpoint read from model.module; no_sync() accumulation; BatchNorm buffers not broadcast."""
    model = DDP(make(bn=True), broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = [p.detach().clone() for p in model.module.parameters()]
    for i in range(10):
        x, y = data(i)
        opt.zero_grad()
        with model.no_sync():
            F.cross_entropy(model(x[:4]), y[:4]).backward()
        F.cross_entropy(model(x[4:]), y[4:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema, model.module.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
            model.module.eval()
            model.module(x)
            model.module.train()
    torch.save(model.module.state_dict(), os.devnull)
    return weights(model) + [float(e.sum()) for e in ema]


def moved_before_wrapping() -> list[float]:
    model = make().double()
    model = DDP(model)
    model.to("cpu")  # already there: nothing moves
    model.double()  # already float64: nothing changes
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(4):
        x, y = data(i)
        opt.zero_grad()
        F.cross_entropy(model(x.double()), y).backward()
        opt.step()
    return weights(model)


def saliency_through_the_bare_module() -> list[float]:
    """Gradients with respect to the input, through model.module: nothing accumulates into the parameters."""
    ddp = DDP(make())
    x, _ = data(0)
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(ddp.module(x).sum(), x)
    return [float(grad.sum())]


def pipeline_stages() -> list[float]:
    """Each rank holds a different stage, wrapped over a group of its own: their parameters differ on purpose."""
    groups = [dist.new_group([0]), dist.new_group([1])]
    torch.manual_seed(rank)
    stage = DDP(torch.nn.Linear(4, 4), process_group=groups[rank])
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    for i in range(3):
        x, _ = data(i)
        opt.zero_grad()
        stage(x).pow(2).mean().backward()
        opt.step()
    return weights(stage) if rank == 0 else []


def fsdp_before_optimizer() -> list[float]:
    from torch.distributed.fsdp import fully_shard

    model = make()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(3):
        x, y = data(i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [float(p.detach().to_local().sum()) for p in model.parameters()]


def uneven() -> list[float]:
    """An uneven last epoch: rank 1 runs out of batches after 3 steps and joins; rank 0 goes on for 12 (and keeps
    being looked at): nothing may wait for rank 1."""
    model = DDP(make())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for i in range(3 if rank == 1 else 12):
            x, y = data(i)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return weights(model)


def main(spawned_rank: int | None = None, out: str = "") -> None:
    global rank
    warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)  # torch 2.13's
    if spawned_rank is not None:
        dist.init_process_group("gloo", rank=spawned_rank, world_size=2)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    for bug in (diverging, alternating, moved, restored, forgotten_zero_grad_with_no_sync, fsdp_after_optimizer,
                evaluated_in_train_mode):
        model = bug()
        # Every rank has published its last fingerprints before the wrapper goes (and they are compared): the test's
        # findings do not depend on which rank finishes first. A program without it may leave its last step uncompared.
        dist.barrier()
        del model
    result = {"correct": correct(), "moved_before_wrapping": moved_before_wrapping(),
              "saliency": saliency_through_the_bare_module(), "pipeline": pipeline_stages(),
              "fsdp": fsdp_before_optimizer(), "uneven": uneven()}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--spawn" in sys.argv:
        import torch.multiprocessing as mp

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", sys.argv[sys.argv.index("--spawn") + 1])
        mp.spawn(main, args=(sys.argv[1],), nprocs=2)
    else:
        main(None, sys.argv[1])
