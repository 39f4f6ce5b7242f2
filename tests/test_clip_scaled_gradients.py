"""ST012: gradient clipping on AMP-scaled gradients before scaler.unscale_."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import ClipScaledGradientsWarning, SafetorchError

from .conftest import findings, lineno

CLIP_NORM = nn.utils.clip_grad_norm_


def _setup(enabled: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=enabled), \
        torch.randn(8, 4)


def _step(clip: Callable[[nn.Module], object], unscale: bool, enabled: bool = True,
          steps: int = 3) -> list[torch.Tensor]:
    model, opt, scaler, x = _setup(enabled)
    for _ in range(steps):
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if unscale:
            scaler.unscale_(opt)
        clip(model)
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()]


def test_clip_before_unscale_warns_at_the_clip_line_with_the_scale() -> None:
    model, opt, scaler, x = _setup()
    with findings() as got:
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0); line = lineno()  # noqa: E702
            scaler.step(opt)
            scaler.update()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(ClipScaledGradientsWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST012 `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)` clips "
                              "gradients still multiplied by the GradScaler's scale (65536)")
    assert "Call scaler.unscale_(optimizer) before clipping" in message


def test_clip_grad_value_and_the_clip_grad_module_too() -> None:
    with findings() as got:
        _step(lambda m: torch.nn.utils.clip_grad.clip_grad_value_(m.parameters(), 0.1), unscale=False)
    assert [w.category for w in got] == [ClipScaledGradientsWarning]
    assert "clips gradient values that are that many times too large" in str(got[0].message)


LOOK_ALIKES: dict[str, tuple[bool, bool]] = {"unscale_ first": (True, True), "scaler disabled": (False, False)}


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alikes_stay_silent_with_the_same_numbers(name: str) -> None:
    unscale, enabled = LOOK_ALIKES[name]

    def clip(m: nn.Module) -> None:
        CLIP_NORM(m.parameters(), 1.0)

    with findings() as got:
        on = _step(clip, unscale, enabled)
    assert got == []
    safetorch.uninstall()
    off = _step(clip, unscale, enabled)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_bf16_autocast_without_a_scaler_and_clipping_after_update_stay_silent() -> None:
    model, opt, scaler, x = _setup()
    with findings() as got:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        CLIP_NORM(model.parameters(), 1.0)
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        CLIP_NORM(model.parameters(), 1.0)
    assert got == []


def test_strict_mode_raises_before_clipping() -> None:
    safetorch.install(strict=True)
    model, opt, scaler, x = _setup()
    scaler.scale(model(x).sum()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        CLIP_NORM(model.parameters(), 1.0)
    assert (info.value.code, info.value.lineno) == ("ST012", line)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))


def test_a_limit_scaled_on_purpose_stays_silent() -> None:
    """``clip_grad_norm_(params, max_norm * scaler.get_scale())``: a limit on the scaled gradients, by design."""
    model, opt, scaler, x = _setup()
    with findings() as got:
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0 * scaler.get_scale())
            scaler.step(opt)
            scaler.update()
    assert got == []


def test_an_fp32_critics_own_gradients_clipped_beside_a_scaled_actor_stay_silent() -> None:
    """The actor's loss is scaled; the critic trains in fp32 with its own loss and clips its own gradients."""

    def program() -> list[torch.Tensor]:
        torch.manual_seed(0)
        actor, critic = nn.Linear(4, 2), nn.Linear(4, 1)
        a_opt, c_opt = torch.optim.SGD(actor.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        x = torch.randn(8, 4)
        for _ in range(3):
            a_opt.zero_grad()
            scaler.scale(actor(x).pow(2).mean()).backward()
            c_opt.zero_grad()
            critic(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)  # unscaled: the critic's own
            c_opt.step()
            scaler.unscale_(a_opt)
            torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
            scaler.step(a_opt)
            scaler.update()
        return [p.detach().clone() for p in [*actor.parameters(), *critic.parameters()]]

    with findings() as got:
        on = program()
    assert got == []
    safetorch.uninstall()
    off = program()
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
