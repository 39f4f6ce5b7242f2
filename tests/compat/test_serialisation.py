"""Models holding patched callables, and models that went through eval()/train(): pickle, deepcopy, torch.save,
DataLoader workers (fork and spawn) and multiprocessing spawn."""

from __future__ import annotations

import copy
import io
import multiprocessing
import pickle
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from .models import convnet


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = convnet()
        self.loss_fn = F.cross_entropy
        self.convert = torch.Tensor.float
        self.bound = torch.zeros(2).double
        self.backward_fn = torch.autograd.backward
        self.empty = torch.cuda.empty_cache
        self.get_enum = torch.nn._reduction.get_enum
        self.train_method = nn.Module.train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.convert(x))


def _holders() -> list[Holder]:
    plain = Holder()
    toggled = Holder()
    toggled.eval()
    toggled.train()
    evaluated = Holder()
    evaluated.eval()
    return [plain, toggled, evaluated]


def _same(a: nn.Module, b: nn.Module) -> None:
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    a.eval()
    b.eval()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    assert a.state_dict().keys() == b.state_dict().keys()


@pytest.mark.parametrize("which", ["plain", "toggled", "evaluated"])
def test_pickle_deepcopy_and_torch_save(which: str) -> None:
    holder = dict(zip(["plain", "toggled", "evaluated"], _holders(), strict=True))[which]
    data = pickle.dumps(holder)
    assert b"safetorch" not in data and b"wrapt" not in data
    _same(holder, pickle.loads(data))
    ema = copy.deepcopy(holder)
    _same(holder, ema)
    buf = io.BytesIO()
    torch.save(holder, buf)
    buf.seek(0)
    _same(holder, torch.load(buf, weights_only=False))


class Data(Dataset[Any]):
    def __init__(self) -> None:
        self.convert = torch.Tensor.double
        self.loss_fn = F.mse_loss

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.convert(torch.full((2,), float(i)))
        return x + self.loss_fn(x, x)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(context: str) -> None:
    loader = DataLoader(Data(), batch_size=4, num_workers=2, multiprocessing_context=context)
    batches = list(loader)
    assert torch.equal(torch.cat(batches), torch.arange(8, dtype=torch.float64).repeat_interleave(2).view(8, 2))
    assert batches[0].dtype == torch.float64


def _in_worker(holder: Holder) -> str:
    out = holder(torch.ones(1, 3, 8, 8, dtype=torch.float64))
    return f"{tuple(out.shape)} {holder.loss_fn.__name__} {holder.convert(torch.ones(1, dtype=torch.int64)).dtype}"


def test_multiprocessing_spawn_with_patched_callables() -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.map(_in_worker, _holders()) == ["(1, 4) cross_entropy torch.float32"] * 3
