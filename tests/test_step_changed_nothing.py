"""ST018: optimizer.step() with finite, non-zero gradients and lr > 0 that changed none of the sampled parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import safetorch
from safetorch import SafetorchError, StepChangedNothingWarning

from .conftest import findings, lineno

F = torch.nn.functional


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _restoring(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """A wrapper that keeps master copies and writes them back after every step (built after the optimizer, it
    never gives the optimizer the copies): every update is lost."""
    master = [p.detach().clone() for p in model.parameters()]

    def restore(optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for p, m in zip(model.parameters(), master, strict=True):
                p.copy_(m)

    opt.register_step_post_hook(restore)


def _train(make: Callable[[Any], torch.optim.Optimizer], steps: int = 4, wrap: Callable[..., None] | None = None,
           dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], int]:
    model = _model().to(dtype)
    opt = make(model.parameters())
    if wrap is not None:
        wrap(model, opt)
    x, y = torch.randn(8, 4, dtype=dtype), torch.randint(0, 3, (8,))
    line = 0
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step(); line = lineno()  # noqa: E702
    return [p.detach().clone() for p in model.parameters()], line


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "NAdam", "RAdam"])
def test_a_step_whose_update_is_put_back_is_found_at_the_step_line(kind: str) -> None:
    make = getattr(torch.optim, kind)
    with findings() as got:
        on, line = _train(make, wrap=_restoring)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(StepChangedNothingWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST018 opt.step() changed nothing: the parameters it holds have finite, non-zero "
                              "gradients and a learning rate above 0")
    assert f"opt = {kind}(model.parameters(), ...)" in message
    safetorch.uninstall()
    off, _ = _train(make, wrap=_restoring)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


LOOK_ALIKES: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD with momentum and weight decay": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "Adadelta defaults": lambda p: torch.optim.Adadelta(p),
    "warm-up from lr=0": lambda p: torch.optim.SGD(p, lr=0.0),
    "maximize": lambda p: torch.optim.SGD(p, lr=0.0, maximize=True),
}


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_steps_that_update_or_may_not_stay_silent_with_the_same_numbers(name: str) -> None:
    with findings() as got:
        on, _ = _train(LOOK_ALIKES[name])
    assert got == []
    safetorch.uninstall()
    off, _ = _train(LOOK_ALIKES[name])
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_an_update_below_half_an_ulp_is_not_this_bug() -> None:
    # bf16 weights with a learning rate too small to move them: stagnation, not a dropped update.
    with findings() as got:
        _train(lambda p: torch.optim.SGD(p, lr=1e-7), dtype=torch.bfloat16)
    assert got == []


def test_radams_first_unrectified_steps_with_small_gradients_are_not_this_bug() -> None:
    """RAdam's first steps (rho_t <= 5) are SGD with momentum, lr * m̂: with small gradients the update rounds away,
    which is stagnation, not a dropped update; it was judged as if Adam's lr-sized first update had been lost."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.full((16,), 1.0))
    opt = torch.optim.RAdam([weight], lr=1e-3)
    with findings() as got:
        for _ in range(4):
            opt.zero_grad()
            (weight * 1e-6 * torch.randn(16)).sum().backward()
            opt.step()
    assert got == []
    assert torch.equal(weight.detach(), torch.full((16,), 1.0))  # the update did round away: nothing moved


def test_radam_put_back_on_its_unrectified_steps_is_still_found() -> None:
    with findings() as got:
        _, line = _train(lambda p: torch.optim.RAdam(p, lr=0.1), steps=3, wrap=_restoring)
    assert [(w.category, w.lineno) for w in got] == [(StepChangedNothingWarning, line)]


def test_zero_gradients_prove_nothing() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with findings() as got:
        for _ in range(3):
            opt.zero_grad()
            (model(torch.randn(2, 4)) * 0).sum().backward()  # gradients exist and are all zero
            opt.step()
    assert got == []


def test_a_custom_optimizer_is_not_judged() -> None:
    class Frozen(torch.optim.SGD):
        def step(self, closure: Any = None) -> None:  # an update of 0 on purpose
            return None

    with findings() as got:
        _train(lambda p: Frozen(p, lr=0.1))
    assert got == []


def test_a_step_that_grad_scaler_skips_is_not_a_finding() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x = torch.randn(8, 4)
    with findings() as got:
        for i in range(4):
            opt.zero_grad()
            loss = model(x).sum() * (float("inf") if i == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)  # skipped at i == 1
            scaler.update()
    assert [w for w in got if w.category is StepChangedNothingWarning] == []


def test_strict_mode_raises_at_the_step() -> None:
    safetorch.install(strict=True)
    with pytest.raises(SafetorchError) as info:
        _train(lambda p: torch.optim.SGD(p, lr=0.1), wrap=_restoring)
    assert info.value.code == "ST018" and info.value.filename == __file__


def test_per_line_suppression_and_ignore() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _restoring(model, opt)
    with findings() as got:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()  # safetorch: ignore[ST018]
    assert got == []
    safetorch.install(ignore=["step-changed-nothing"])
    with findings() as got:
        _train(lambda p: torch.optim.SGD(p, lr=0.1), wrap=_restoring)
    assert got == []


def test_the_decision_takes_the_accelerator_path_without_a_host_read(device_path: None) -> None:
    with findings() as got:
        _, line = _train(lambda p: torch.optim.SGD(p, lr=0.1), wrap=_restoring, steps=6)
        from safetorch import _deferred

        _deferred.poll(wait=True)
    assert [(w.category, w.lineno) for w in got] == [(StepChangedNothingWarning, line)]
