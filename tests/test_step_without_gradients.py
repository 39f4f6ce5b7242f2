"""ST010: optimizer.step() while no parameter it holds has a gradient."""

from __future__ import annotations

import copy

import pytest
import torch

import safetorch
from safetorch import SafetorchError, StepWithoutGradientsWarning

from .conftest import findings, lineno


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(8, 4), torch.randint(0, 3, (8,))


def test_traincheck_adadelta_over_a_frozen_head_warns_on_the_first_step() -> None:
    """TrainCheck (OSDI'25)'s user-code bug: the optimizer holds the classifier head, which is then frozen; the
    backbone (with BatchNorm) trains, but is not in the optimizer."""
    x, y = _data()
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
    head = torch.nn.Linear(8, 3)
    optimizer = torch.optim.Adadelta(head.parameters())
    for p in head.parameters():
        p.requires_grad = False
    before = [p.clone() for p in head.parameters()]
    with findings() as got:
        loss = torch.nn.functional.cross_entropy(head(backbone(x)), y)
        loss.backward()
        optimizer.step(); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(StepWithoutGradientsWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST010 optimizer.step() updates nothing: none of the 2 parameters Adadelta holds")
    assert "every one is frozen" in message and "p.requires_grad" in message
    assert all(torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True))


def test_zero_grad_between_backward_and_step() -> None:
    x, y = _data()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with findings() as got:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.zero_grad()
        opt.step(); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(StepWithoutGradientsWarning, line)]
    message = str(got[0].message)
    assert message.startswith("ST010 opt.step() updates nothing: none of the 2 parameters SGD holds has a gradient.")
    assert "zero_grad() runs between loss.backward() and opt.step()" in message


def test_an_optimizer_over_a_stale_copy() -> None:
    x, y = _data()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = copy.deepcopy(model)  # what .to()-by-copy, or re-creating the model after the optimizer, amounts to
    with findings() as got:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step(); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(StepWithoutGradientsWarning, line)]
    assert "built over other tensors than the loss uses" in str(got[0].message)


def test_look_alikes_stay_silent_and_train_identically() -> None:
    def run() -> list[torch.Tensor]:
        x, y = _data()
        experts = torch.nn.ModuleList([torch.nn.Linear(4, 3) for _ in range(2)])
        opt = torch.optim.SGD([{"params": experts[0].parameters()}, {"params": experts[1].parameters()}], lr=0.1)
        for step in range(4):
            opt.zero_grad()
            # MoE routing: one expert gets no gradient this step
            torch.nn.functional.cross_entropy(experts[step % 2](x), y).backward()
            opt.step()
        lbfgs = torch.optim.LBFGS(experts[0].parameters(), max_iter=3)

        def closure() -> torch.Tensor:
            lbfgs.zero_grad()
            loss = torch.nn.functional.cross_entropy(experts[0](x), y)
            loss.backward()
            return loss

        lbfgs.step(closure)  # gradients are made inside step(): nothing to see before it
        return [p.detach().clone() for p in experts.parameters()]

    with findings() as got:
        on = run()
    assert got == []
    safetorch.uninstall()
    off = run()
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_strict_mode_raises_at_the_step_line_before_the_step() -> None:
    safetorch.install(strict=True)
    model = torch.nn.Linear(4, 3)
    model.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        opt.step()
    assert (info.value.code, info.value.lineno) == ("ST010", line)


def test_per_line_suppression_and_ignore() -> None:
    model = torch.nn.Linear(4, 3)
    model.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with findings() as got:
        opt.step()  # safetorch: ignore[ST010]
    assert got == []
    safetorch.install(ignore=["step-without-gradients"])
    with findings() as got:
        opt.step()
    assert got == []


def test_steps_after_the_first_are_sampled() -> None:
    from safetorch import _steps

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    for _ in range(_steps.FIRST):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    with findings() as got:
        opt.step()  # step FIRST + 1: not looked at
    assert got == [] and _steps.looked_at(opt) == _steps.FIRST + 1
