"""ST017: a DDP-wrapped module trained through its bare forward, or moved/cast after wrapping. In-process, on a gloo
group of one rank (the multi-process jobs are in test_distributed.py)."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Iterator

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import safetorch
from safetorch import DdpBypassedWarning, SafetorchError

from .conftest import findings, lineno, one_rank_group

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _group() -> Iterator[None]:
    with one_rank_group():
        yield


def _make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _alternate(steps: int = 4) -> tuple[list[torch.Tensor], int]:
    model = _make()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    line = 0
    for i in range(steps):
        opt.zero_grad()
        if i % 2 == 0:
            out = model(x); line = lineno()  # noqa: E702
        else:
            out = ddp(x)
        F.cross_entropy(out, y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], line


def test_a_backward_through_the_bare_module_is_found_at_its_forward_line() -> None:
    with findings() as got:
        on, line = _alternate()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(DdpBypassedWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST017 `model(x)` runs the module that DistributedDataParallel wraps through its own "
                              "forward, and backward() trains its parameters")
    assert "Call the wrapper: out = ddp_model(x)" in message
    safetorch.uninstall()
    off, _ = _alternate()
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_the_bare_module_s_look_alikes_stay_silent() -> None:
    model = _make()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    ema = copy.deepcopy(model)
    with findings() as got:
        for _ in range(3):
            opt.zero_grad()
            with ddp.no_sync():  # accumulation without synchronising, through the bare module: averaged later
                F.cross_entropy(model(x[:4]), y[:4]).backward()
            F.cross_entropy(ddp(x[4:]), y[4:]).backward()
            opt.step()
            with torch.no_grad():  # evaluation through the bare module
                model(x)
                for e, p in zip(ema.parameters(), ddp.module.parameters(), strict=True):
                    e.mul_(0.9).add_(p, alpha=0.1)
            model(x)  # a forward with autograd on whose graph no backward reaches
            xs = x.clone().requires_grad_(True)
            torch.autograd.grad(model(xs).sum(), xs)  # saliency: nothing accumulates into the parameters
        torch.save(ddp.module.state_dict(), io.BytesIO())
    assert got == []


def test_a_wrapped_module_still_pickles_deep_copies_and_saves() -> None:
    model = _make()
    DDP(model)
    clone = pickle.loads(pickle.dumps(model))
    assert all(torch.equal(a, b) for a, b in zip(clone.parameters(), model.parameters(), strict=True))
    copy.deepcopy(model)
    torch.save(model, io.BytesIO())


def test_a_cast_after_wrapping_is_found_at_its_line_and_a_no_op_move_is_not() -> None:
    ddp = DDP(_make())
    with findings() as got:
        ddp.to("cpu")  # already there
        ddp.float()  # already float32
        ddp.module.double(); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(DdpBypassedWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST017 `ddp.module.double()` moved parameters that DistributedDataParallel already "
                              "wraps (from torch.float32 to torch.float64)")
    assert "then wrap it: model.to(device); ddp_model = DDP(model, device_ids=[rank])" in message
    assert next(ddp.parameters()).dtype is torch.float64  # the cast itself still happened


def test_moving_before_wrapping_is_silent() -> None:
    with findings() as got:
        model = _make().double().to("cpu")
        DDP(model)
    assert got == []


def test_a_wrapper_that_is_gone_is_forgotten() -> None:
    from safetorch import _ddp

    model = _make()
    ddp = DDP(model)
    assert id(ddp) in _ddp.live
    del ddp
    import gc

    gc.collect()
    assert not _ddp.live and not model._forward_pre_hooks
    with findings() as got:
        model.double()
        model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert got == []


def test_strict_mode_raises_and_ignore_and_suppression_work() -> None:
    safetorch.install(strict=True)
    ddp = DDP(_make())
    with pytest.raises(SafetorchError) as info:
        ddp.double()
    assert info.value.code == "ST017" and info.value.filename == __file__
    safetorch.install(strict=False, ignore=["ddp-bypassed"])
    with findings() as got:
        DDP(_make()).double()
    assert got == []
    safetorch.install(ignore=[])
    with findings() as got:
        DDP(_make()).double()  # safetorch: ignore[ST017]
    assert got == []


def test_uninstall_removes_every_hook() -> None:
    model = _make()
    ddp = DDP(model)
    safetorch.uninstall()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not ddp._forward_pre_hooks and not ddp._forward_hooks
    safetorch.install()
