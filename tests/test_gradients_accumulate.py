"""ST011: gradients accumulate across optimizer steps (zero_grad() forgotten)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import pytest
import torch

import safetorch
from safetorch import GradientsAccumulateWarning, SafetorchError

from .conftest import findings, lineno

F = torch.nn.functional


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 4), torch.randint(0, 3, (8,))


def test_forgotten_zero_grad_warns_at_the_step_line_on_the_second_step() -> None:
    model, opt, x, y = _setup()
    with findings() as got:
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
            opt.step(); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GradientsAccumulateWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST011 opt.step() uses the sum of the gradients of every step so far")
    assert "Call opt.zero_grad() once per step" in message


def _train(reset: Callable[[torch.nn.Module, torch.optim.Optimizer], None], micro: int = 1,
           steps: int = 5) -> list[torch.Tensor]:
    model, opt, x, y = _setup()
    for _ in range(steps):
        reset(model, opt)
        for k in range(micro):
            F.cross_entropy(model(x[k::micro]), y[k::micro]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _manual_none(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = None


def _manual_zero(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _data_zero(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.zero_()  # invisible to version counters


RESETS = {
    "optimizer.zero_grad()": lambda m, o: o.zero_grad(),
    "optimizer.zero_grad(set_to_none=False)": lambda m, o: o.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda m, o: m.zero_grad(),
    "p.grad = None": _manual_none,
    "p.grad.zero_()": _manual_zero,
    "p.grad.data.zero_()": _data_zero,
}


@pytest.mark.parametrize("name", RESETS)
@pytest.mark.parametrize("micro", [1, 4])
def test_every_way_of_resetting_stays_silent_with_the_same_numbers(name: str, micro: int) -> None:
    with findings() as got:
        on = _train(RESETS[name], micro)
    assert got == []
    safetorch.uninstall()
    off = _train(RESETS[name], micro)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_the_forgetful_loop_trains_identically_on_and_off() -> None:
    with findings():
        on = _train(lambda m, o: None)
    safetorch.uninstall()
    off = _train(lambda m, o: None)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


@pytest.mark.parametrize("depth", [1, 2])
def test_a_gan_whose_discriminator_loss_reaches_the_generator_stays_silent(depth: int) -> None:
    """With one linear layer each, the discriminator's backward cancels the generator's gradient exactly; with two
    it does not: both reset before the generator's own backward, both silent."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(depth)], torch.nn.Tanh())
    disc = torch.nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    z = torch.randn(8, 4)
    with findings() as got:
        for _ in range(4):
            opt_d.zero_grad()
            d_loss = disc(gen(z)).mean()  # no detach: this backward adds to the generator's old gradients
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad(set_to_none=False)  # ... which are reset before the generator's own backward
            (-disc(gen(z)).mean()).backward()
            opt_g.step()
    assert got == []


def test_gradient_accumulation_then_zero_after_the_step_stays_silent() -> None:
    model, opt, x, y = _setup()
    with findings() as got:
        for i in range(16):
            (F.cross_entropy(model(x), y) / 4).backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()
    assert got == []


def test_strict_mode_raises_at_the_second_step() -> None:
    safetorch.install(strict=True)
    model, opt, x, y = _setup()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    F.cross_entropy(model(x), y).backward()
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        opt.step()
    assert (info.value.code, info.value.lineno) == ("ST011", line)


def test_a_watched_parameter_saves_without_its_hook_and_without_a_warning() -> None:
    def saved() -> bytes:
        model, opt, x, y = _setup()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()  # watched until the next step: a hook sits on the first parameter
        buffer = io.BytesIO()
        torch.save(model, buffer)
        return buffer.getvalue()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on = saved()
    safetorch.uninstall()
    off = saved()
    safetorch.install()
    assert on == off


def test_uninstall_removes_the_watch_hooks() -> None:
    model, opt, x, y = _setup()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    first = next(model.parameters())
    assert first._backward_hooks
    safetorch.uninstall()
    assert not first._backward_hooks
    safetorch.install()


def test_per_line_suppression() -> None:
    model, opt, x, y = _setup()
    with findings() as got:
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
            opt.step()  # safetorch: ignore[ST011]
    assert got == []


def test_no_watch_outlives_the_looked_at_steps() -> None:
    """A watch starts only when the next step is looked at too, which ends it: between samples no parameter carries
    a hook, so a backward pays nothing for ST011."""
    from safetorch import _steps

    model, opt, x, y = _setup()
    for _ in range(_steps.FIRST + 4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    # torch's state, not an empty dict: an empty one still costs every backward (the C++ runner stays)
    assert all(p._backward_hooks is None for p in model.parameters())


def test_a_hook_of_the_program_on_the_watched_parameter_stays_and_fires() -> None:
    from safetorch import _steps

    model, opt, x, y = _setup()
    first = next(model.parameters())
    seen: list[torch.Size] = []
    first.register_hook(lambda g: seen.append(g.shape))
    for _ in range(_steps.FIRST + 4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert len(first._backward_hooks) == 1 and len(seen) == _steps.FIRST + 4
    F.cross_entropy(model(x), y).backward()
    assert len(seen) == _steps.FIRST + 5


def test_a_parameter_watched_once_costs_no_later_backward_its_gradient_is_not_copied() -> None:
    """After the looked-at steps the watched parameter's gradient is accumulated as it is without safetorch: the
    first backward after zero_grad(set_to_none=True) hands over the incoming gradient, not a copy of it."""
    from safetorch import _steps

    def steals(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> bool:
        first = next(model.parameters())
        opt.zero_grad(set_to_none=True)
        out = model(x)
        grads: list[torch.Tensor] = []
        first.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad))
        F.cross_entropy(out, y).backward()
        return grads[0] is first.grad

    model, opt, x, y = _setup()
    for _ in range(_steps.FIRST + 4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert next(model.parameters())._backward_hooks is None
    assert steals(model, opt, x, y)


# The loop shapes of the reference trainers (torchvision's classification reference, timm's train.py, cleanrl's PPO),
# written here: something changes every gradient in place between backward() and step(). ``forget`` drops the
# zero_grad() the real loop has.
def _clip(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the small limit clips at every step


def _average(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():  # what a hand-written all_reduce then divide does to a rank's gradient
        if p.grad is not None:
            p.grad.mul_(0.5).add_(0.01)


def _reference_loop(between: Callable[[torch.nn.Module, torch.optim.Optimizer], None], forget: bool,
                    set_to_none: bool = True, scaler: bool = False) -> tuple[list[torch.Tensor], int | None]:
    model, opt, x, y = _setup()
    amp = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    line = None
    for _epoch in range(2):
        for k in range(3):  # minibatches (PPO's update epochs over a rollout)
            if not forget:
                opt.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(model(x[k::3]), y[k::3])
            if amp is not None:
                amp.scale(loss).backward()
                amp.unscale_(opt)
                between(model, opt)
                amp.step(opt); line = lineno()  # noqa: E702
                amp.update()
            else:
                loss.backward()
                between(model, opt)
                opt.step(); line = lineno()  # noqa: E702
    return [p.detach().clone() for p in model.parameters()], line


SHAPES = {"clip_grad_norm_ (torchvision, cleanrl)": (_clip, False), "GradScaler.unscale_ + clip (timm)": (_clip, True),
          "all_reduce by hand": (_average, False)}


@pytest.mark.parametrize("shape", SHAPES)
def test_a_forgotten_zero_grad_is_found_when_gradients_change_in_place_before_the_step(shape: str) -> None:
    between, scaler = SHAPES[shape]
    with findings() as got:
        on, line = _reference_loop(between, forget=True, scaler=scaler)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GradientsAccumulateWarning, __file__, line)]
    assert "step() uses the sum of the gradients of every step so far" in str(got[0].message)
    safetorch.uninstall()
    off, _ = _reference_loop(between, forget=True, scaler=scaler)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_reference_loops_with_their_zero_grad_stay_silent_with_the_same_numbers(shape: str,
                                                                                     set_to_none: bool) -> None:
    between, scaler = SHAPES[shape]
    with findings() as got:
        on, _ = _reference_loop(between, forget=False, set_to_none=set_to_none, scaler=scaler)
    assert got == []
    safetorch.uninstall()
    off, _ = _reference_loop(between, forget=False, set_to_none=set_to_none, scaler=scaler)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_a_reset_after_the_last_backward_stays_silent() -> None:
    # zero_grad() between backward() and step() is ST010's finding (nothing to update), never ST011's.
    model, opt, x, y = _setup()
    with findings() as got:
        for _ in range(4):
            F.cross_entropy(model(x), y).backward()
            opt.zero_grad(set_to_none=False)
            opt.step()
    assert [w for w in got if w.category is GradientsAccumulateWarning] == []


def _lbfgs(zero: bool, calls: int = 4) -> tuple[list[torch.Tensor], int]:
    model, _, x, y = _setup()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=calls, history_size=3)

    def closure() -> torch.Tensor:
        if zero:
            opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure); line = lineno()  # noqa: E702
    return [p.detach().clone() for p in model.parameters()], line


def test_a_closure_that_forgets_zero_grad_is_found_at_the_step_line() -> None:
    with findings() as got:
        on, line = _lbfgs(zero=False)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GradientsAccumulateWarning, __file__, line - 0)]
    message = str(got[0].message)
    assert message.startswith("ST011 the closure passed to opt.step(closure) does not reset the gradients")
    assert "Call opt.zero_grad() first thing in the closure" in message
    safetorch.uninstall()
    off, _ = _lbfgs(zero=False)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_a_closure_that_zeroes_stays_silent_with_the_same_numbers() -> None:
    with findings() as got:
        on, _ = _lbfgs(zero=True)
    assert got == []
    safetorch.uninstall()
    off, _ = _lbfgs(zero=True)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_the_closures_watched_parameter_is_left_as_torch_found_it() -> None:
    model, _, x, y = _setup()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4, history_size=3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    assert all(p._backward_hooks is None for p in model.parameters())


def test_an_optimizer_dropped_mid_watch_leaves_its_parameter_to_the_next_looked_at_step() -> None:
    """Its finalizer may run in the middle of a backward (a garbage collection): it only queues the parameter."""
    import gc

    model, opt, x, y = _setup()
    first = next(model.parameters())
    F.cross_entropy(model(x), y).backward()
    opt.step()  # looked at: the first parameter is watched until this optimizer's next step
    assert first._backward_hooks
    del opt
    gc.collect()
    assert first._backward_hooks is not None and not first._backward_hooks  # the hook gone, the runner queued
    F.cross_entropy(model(x), y).backward()
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    second.zero_grad()
    F.cross_entropy(model(x), y).backward()
    second.step()  # a looked-at step puts it back (and watches the parameter again until the next one)
    second.zero_grad()
    F.cross_entropy(model(x), y).backward()
    second.step()
    for _ in range(8):
        second.step()
    assert first._backward_hooks is None


def test_a_closure_called_once_per_step_that_accumulates_on_purpose_stays_silent() -> None:
    # Lightning's automatic optimisation with accumulate_grad_batches: the batches before the stepping one backward
    # outside step(), and the stepping batch's closure adds to them without zeroing (it zeroed at the first batch).
    model, opt, x, y = _setup()

    def closure() -> torch.Tensor:
        loss = F.cross_entropy(model(x[4:]), y[4:]) / 2
        loss.backward()
        return loss

    with findings() as got:
        for _ in range(4):
            opt.zero_grad()
            (F.cross_entropy(model(x[:4]), y[:4]) / 2).backward()
            opt.step(closure)
    assert got == []
