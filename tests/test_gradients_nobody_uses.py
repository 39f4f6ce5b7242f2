"""ST020: parameters no optimizer holds keep accumulating gradients (a loss network never frozen)."""

from __future__ import annotations

import gc
import io
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import GradientsNobodyUsesWarning, SafetorchError, _deferred, _steps
from safetorch.checks import gradients_nobody_uses

from .conftest import findings, lineno, on_and_off

F = nn.functional


@pytest.fixture(autouse=True)
def _no_watch_from_another_test() -> Iterator[None]:
    """A watch another test's program began (its loss network alive) would hold off this test's first look."""
    gradients_nobody_uses.reset()
    yield
    gradients_nobody_uses.reset()

Nets = tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]


def _nets() -> Nets:
    """A generator trained through a perceptual loss: a small conv "loss network" in eval mode, requires_grad left
    on, and an optimizer over the generator only."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1))
    vgg = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
    return gen, vgg, torch.optim.Adam(gen.parameters(), lr=1e-3), torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)


def _numbers(*modules: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for m in modules for p in m.parameters()
            for t in ([p] if p.grad is None else [p, p.grad])]


def _perceptual(steps: int = 5) -> list[torch.Tensor]:
    gen, vgg, opt, x, target = _nets()
    for _ in range(steps):
        opt.zero_grad()
        out = gen(x)
        loss = F.mse_loss(vgg(out), vgg(target))
        loss.backward()
        opt.step()
    return _numbers(gen, vgg)


def test_a_perceptual_loss_network_left_trainable_is_found_at_the_backward_line() -> None:
    gen, vgg, opt, x, target = _nets()
    with findings() as got:
        for _ in range(5):
            opt.zero_grad()
            loss = F.mse_loss(vgg(gen(x)), vgg(target))
            loss.backward(); line = lineno()  # noqa: E702
            opt.step()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GradientsNobodyUsesWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST020 loss.backward() computes gradients for vgg (a Sequential, 4 parameters, 808 "
                              "elements) that no optimizer holds: each backward adds them to .grad")
    assert "Write: vgg.requires_grad_(False) once, after building it (or pass vgg.parameters() to an optimizer" \
        in message
    assert ".eval()" not in message.split("Write:")[1]  # already in eval mode (and without dropout or BatchNorm)


def test_the_perceptual_loop_trains_identically_on_and_off() -> None:
    got, same = on_and_off(_perceptual)
    assert [w.category for w in got] == [GradientsNobodyUsesWarning]
    assert same


def test_the_finding_is_decided_at_the_third_step_and_the_watch_leaves_nothing_behind() -> None:
    gen, vgg, opt, x, target = _nets()
    params = list(vgg.parameters())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for step in range(1, 5):
            opt.zero_grad()
            F.mse_loss(vgg(gen(x)), vgg(target)).backward()
            opt.step()
            assert len(got) == (step >= 3)  # watched from the 2nd backward, through the 2nd and 3rd steps
    assert all(p._backward_hooks is None for p in params)  # as torch leaves them: no hook runner left behind
    assert gradients_nobody_uses._state.watch is None and gradients_nobody_uses._state.step_hook is None
    assert gradients_nobody_uses._state.stale_hook is None  # taken away at the 4th backward
    opt.zero_grad()
    F.mse_loss(vgg(gen(x)), vgg(target)).backward()  # armed at the 4th step: found already, not watched again
    assert gradients_nobody_uses._state.watch is None and not gradients_nobody_uses._state.listening


def test_a_criterion_module_holding_the_loss_network_is_named() -> None:
    class PerceptualLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.features(a), self.features(b))

    gen, _, opt, x, target = _nets()
    criterion = PerceptualLoss()  # in training mode: its BatchNorm updates running statistics every step
    with findings() as got:
        for _ in range(4):
            opt.zero_grad()
            criterion(gen(x), target).backward()
            opt.step()
    message = str(got[0].message)
    assert message.startswith("ST020 criterion(gen(x), target).backward() computes gradients for criterion (a "
                              "PerceptualLoss, 4 parameters, 240 elements)")
    assert "Its dropout/BatchNorm layers are in training mode too. Write: criterion.requires_grad_(False).eval()" \
        in message


def test_a_backbone_left_out_of_the_optimizer_is_named_by_its_path() -> None:
    """Training only the head by giving the optimizer the head's parameters: the backbone still gets gradients. Part
    of a model the optimizer trains another part of, it is decided after 8 steps (progressive unfreezing adds such a
    part within a few steps)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("backbone", nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    model.add_module("head", nn.Linear(8, 2))
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with findings() as got:
        for _ in range(10):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    message = str(got[0].message)
    assert "computes gradients for model.backbone (a Sequential, 2 parameters, 40 elements)" in message
    assert "Write: model.backbone.requires_grad_(False) once" in message


def test_parameters_no_frame_names_are_described_by_their_shape() -> None:
    gen, vgg, opt, x, target = _nets()
    nets = [vgg]  # a list: not looked into
    del vgg

    def loss_of(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(nets[0](a), nets[0](b))

    with findings() as got:
        for _ in range(4):
            opt.zero_grad()
            torch.autograd.backward(loss_of(gen(x), target)); line = lineno()  # noqa: E702
            opt.step()
    assert [(w.category, w.lineno) for w in got] == [(GradientsNobodyUsesWarning, line)]
    message = str(got[0].message)
    assert message.startswith("ST020 torch.autograd.backward() computes gradients for 4 parameters (808 elements, "
                              "the first of shape 8)")  # the walk meets the last layer's bias first
    assert "Write: <module>.requires_grad_(False), on the module that holds them, once" in message


def test_layers_kept_in_a_plain_list_are_found_with_the_module_list_to_write() -> None:
    """Layers in a Python list are never registered: model.parameters() leaves them out, so they are never trained,
    and each backward adds to their .grad. The fix is how they are held, not a freeze."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(4, 4) for _ in range(2)]
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with findings() as got:
        for _ in range(4):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward(); line = lineno()  # noqa: E702
            opt.step()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GradientsNobodyUsesWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST020 loss.backward() computes gradients for model.layers (a plain Python list of 2 "
                              "Linear, 4 parameters, 40 elements) that no optimizer holds: nn.Module registers no "
                              "module kept in a plain list, so model.parameters() leaves them out and they are never "
                              "trained")
    assert message.endswith("Write: self.layers = nn.ModuleList([...]) in Net.__init__, then build the optimizer "
                            "from model.parameters() (safetorch explain ST020)")
    assert "requires_grad_(False)" not in message and "loss_net" not in message


# The look-alikes: each silent, with the same numbers on and off.

def _frozen_loss_network() -> list[torch.Tensor]:
    gen, vgg, opt, x, target = _nets()
    vgg.requires_grad_(False)
    for _ in range(5):
        opt.zero_grad()
        F.mse_loss(vgg(gen(x)), vgg(target)).backward()
        opt.step()
    return _numbers(gen, vgg)


def _loss_network_zeroed_each_step() -> list[torch.Tensor]:
    gen, vgg, opt, x, target = _nets()
    for _ in range(5):
        opt.zero_grad()
        F.mse_loss(vgg(gen(x)), vgg(target)).backward()
        opt.step()
        vgg.zero_grad(set_to_none=False)  # zeros, kept: the next backward finds its chain broken
    return _numbers(gen, vgg)


def _gan() -> list[torch.Tensor]:
    """No detach: the discriminator's backward reaches the generator, whose optimizer holds it (and zeroes it)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    disc = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    z, real = torch.randn(8, 4), torch.randn(8, 4)
    for _ in range(6):
        opt_d.zero_grad()
        (F.softplus(disc(gen(z))).mean() + F.softplus(-disc(real)).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        F.softplus(-disc(gen(z))).mean().backward()
        opt_g.step()
    return _numbers(gen, disc)


def _two_optimizers() -> list[torch.Tensor]:
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(4, 3), nn.Linear(3, 4)
    opt_e, opt_d = torch.optim.SGD(encoder.parameters(), lr=0.1), torch.optim.Adam(decoder.parameters())
    x = torch.randn(8, 4)
    for _ in range(5):
        opt_e.zero_grad()
        opt_d.zero_grad()
        F.mse_loss(decoder(encoder(x)), x).backward()
        opt_e.step()
        opt_d.step()
    return _numbers(encoder, decoder)


def _saliency_then_zeroed() -> list[torch.Tensor]:
    """Gradients of a model no optimizer holds, read for analysis, then zeroed."""
    torch.manual_seed(0)
    model, analysed = nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    norms = []
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        analysed(x).max(dim=1).values.sum().backward()
        norms.append(torch.stack([p.grad.norm() for p in analysed.parameters()]))
        analysed.zero_grad(set_to_none=False)
    return [*_numbers(model, analysed), *norms]


def _saliency_by_autograd_grad() -> list[torch.Tensor]:
    """A saliency map of a model no optimizer holds, taken with torch.autograd.grad: nothing accumulates."""
    torch.manual_seed(0)
    model, analysed = nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    maps = []
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        probe = x.clone().requires_grad_(True)
        (saliency,) = torch.autograd.grad(analysed(probe).max(dim=1).values.sum(), probe)
        maps.append(saliency)
    assert all(p.grad is None for p in analysed.parameters())
    return [*_numbers(model, analysed), *maps]


def _adversarial_inputs() -> list[torch.Tensor]:
    """A perturbation that requires grad, kept across steps and never zeroed: a leaf tensor, not a parameter."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    delta = torch.zeros(8, 4, requires_grad=True)
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(x + delta), y).backward()
        opt.step()
    assert delta.grad is not None
    return [*_numbers(model), delta.grad.clone()]


def _teacher_and_ema_under_no_grad() -> list[torch.Tensor]:
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 2), nn.Linear(4, 2)
    ema = torch.optim.swa_utils.AveragedModel(student)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(5):
        with torch.no_grad():
            soft = teacher(x).softmax(dim=1)
            ema_out = ema(x)
        opt.zero_grad()
        (F.cross_entropy(student(x), soft) + F.mse_loss(student(x), ema_out)).backward()
        opt.step()
        ema.update_parameters(student)
    return _numbers(student, teacher, ema)


def _manual_zero(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _manual_none(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _data_zero(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.zero_()  # invisible to version counters


RESETS: dict[str, Callable[[nn.Module], None]] = {
    "model.zero_grad()": lambda m: m.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda m: m.zero_grad(set_to_none=False),
    "p.grad = None": _manual_none,
    "p.grad.zero_()": _manual_zero,
    "p.grad.data.zero_()": _data_zero,
}


def _updated_by_hand(reset: Callable[[nn.Module], None], before_step: bool = False) -> list[torch.Tensor]:
    """A model whose parameters are updated by hand (no optimizer) and reset each step, beside one an optimizer
    trains (whose steps are looked at); the update after the optimizer's step, or before it (between the last
    backward and the step that decides)."""
    torch.manual_seed(0)
    model, by_hand = nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def update() -> None:
        with torch.no_grad():
            for p in by_hand.parameters():
                p -= 0.1 * p.grad
        reset(by_hand)

    for _ in range(6):
        opt.zero_grad()
        (F.cross_entropy(model(x), y) + F.cross_entropy(by_hand(x), y)).backward()
        if before_step:
            update()
        opt.step()
        if not before_step:
            update()
    return _numbers(model, by_hand)


LOOK_ALIKES: dict[str, Callable[[], list[torch.Tensor]]] = {
    "a frozen loss network": _frozen_loss_network,
    "a loss network zeroed each step": _loss_network_zeroed_each_step,
    "a GAN's generator reached by the discriminator's backward": _gan,
    "a second optimizer's model": _two_optimizers,
    "saliency read, then zeroed": _saliency_then_zeroed,
    "saliency by torch.autograd.grad": _saliency_by_autograd_grad,
    "adversarial inputs": _adversarial_inputs,
    "a teacher and an EMA under no_grad": _teacher_and_ema_under_no_grad,
    **{f"updated by hand, then {name}": (lambda r=reset: _updated_by_hand(r)) for name, reset in RESETS.items()},
    **{f"updated by hand before the step, then {name}": (lambda r=reset: _updated_by_hand(r, before_step=True))
       for name, reset in RESETS.items() if "None" not in name},
}


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_a_look_alike_stays_silent_with_the_same_numbers(name: str) -> None:
    got, same = on_and_off(LOOK_ALIKES[name])
    assert got == []
    assert same


def test_parameters_an_optimizer_gets_during_the_watch_stay_silent() -> None:
    gen, vgg, opt, x, target = _nets()
    with findings() as got:
        for step in range(5):
            opt.zero_grad()
            F.mse_loss(vgg(gen(x)), vgg(target)).backward()
            opt.step()
            if step == 1:  # watched since the 2nd backward: then fine-tuned from the 3rd step on
                opt.add_param_group({"params": vgg.parameters(), "lr": 1e-5})
                vgg.zero_grad()
    assert got == []


def test_strict_mode_raises_naming_the_backward_line() -> None:
    safetorch.install(strict=True)
    gen, vgg, opt, x, target = _nets()
    with pytest.raises(SafetorchError) as info:
        for _ in range(5):
            opt.zero_grad()
            F.mse_loss(vgg(gen(x)), vgg(target)).backward(); line = lineno()  # noqa: E702
            opt.step()
    assert (info.value.code, info.value.lineno) == ("ST020", line)


@pytest.mark.parametrize("ignore", ["ST020", "gradients-nobody-uses"])
def test_ignore_switches_it_off(ignore: str) -> None:
    safetorch.install(ignore=[ignore])
    with findings() as got:
        _perceptual()
    assert got == []
    assert gradients_nobody_uses._state.watch is None and not gradients_nobody_uses._state.listening


def test_a_per_line_suppression_silences_it() -> None:
    gen, vgg, opt, x, target = _nets()
    with findings() as got:
        for _ in range(5):
            opt.zero_grad()
            loss = F.mse_loss(vgg(gen(x)), vgg(target))
            loss.backward()  # safetorch: ignore[ST020]
            opt.step()
    assert got == []


def test_it_is_reported_once_per_line_and_looked_at_again_only_in_a_sample_window() -> None:
    gc.collect()  # an optimizer of an earlier test, in a cycle, would keep its own first steps looked at
    gen, vgg, opt, x, target = _nets()
    with findings() as got:
        for _ in range(20):
            opt.zero_grad()
            F.mse_loss(vgg(gen(x)), vgg(target)).backward()
            opt.step()
    assert [w.category for w in got] == [GradientsNobodyUsesWarning]
    assert not _steps.armed() and not gradients_nobody_uses._state.listening  # the first window has closed
    assert gradients_nobody_uses._state.watch is None and gradients_nobody_uses._state.step_hook is None


def test_a_watched_parameter_saves_without_its_hook_and_without_a_warning() -> None:
    gen, vgg, opt, x, target = _nets()
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(vgg(gen(x)), vgg(target)).backward()
        opt.step()
    assert any(p._backward_hooks for p in vgg.parameters())  # watched since the 2nd backward
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.save(vgg, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(not p._backward_hooks for p in loaded.parameters())


def test_a_watch_given_up_inside_its_own_hook_leaves_the_parameters_as_torch_does() -> None:
    """From the third step on the program resets the loss network's gradients (a look-alike: silent); the watch
    begun at the second backward gives up at the third, from inside its tensor hook, and the hook runner goes at the
    next backward."""
    gen, vgg, opt, x, target = _nets()
    with findings() as got:
        for step in range(5):
            opt.zero_grad()
            if step >= 2:
                vgg.zero_grad(set_to_none=True)
            F.mse_loss(vgg(gen(x)), vgg(target)).backward()
            opt.step()
    assert got == []
    assert all(p._backward_hooks is None for p in vgg.parameters())


def test_uninstall_takes_every_hook_away_during_a_watch() -> None:
    gen, vgg, opt, x, target = _nets()
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(vgg(gen(x)), vgg(target)).backward()
        opt.step()
    assert gradients_nobody_uses._state.step_hook is not None
    safetorch.uninstall()
    assert all(not p._backward_hooks for p in vgg.parameters())
    assert gradients_nobody_uses._state.step_hook is None and not gradients_nobody_uses._state.listening
    safetorch.install()


@pytest.mark.usefixtures("device_path")
def test_device_path_the_decision_is_read_once_the_device_has_computed_it_without_a_host_read() -> None:
    from bench.nosync import Reads

    gen, vgg, opt, x, target = _nets()
    with findings() as got, Reads() as reads:
        for _ in range(4):
            opt.zero_grad()
            loss = F.mse_loss(vgg(gen(x)), vgg(target))
            loss.backward(); line = lineno()  # noqa: E702
            opt.step()
        _deferred.poll(wait=True)
    assert [r for r in reads.found if "gradients_nobody_uses" in r] == []
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GradientsNobodyUsesWarning, __file__, line)]
    assert str(got[0].message).startswith("ST020 loss.backward() computes gradients for vgg")


@pytest.mark.usefixtures("device_path")
def test_device_path_a_reset_by_value_stays_silent() -> None:
    """``p.grad.zero_()`` keeps the same tensor: only the values show the reset, compared on the device."""
    got, same = on_and_off(lambda: _updated_by_hand(_manual_zero))
    _deferred.poll(wait=True)
    assert got == []
    assert same


def test_neural_style_lbfgs_closure_steps_are_looked_at() -> None:
    """The PyTorch neural-style tutorial's shape: the image is optimized with LBFGS through `step(closure)`, and the
    VGG loss network is only put in eval mode (its gradients pile up over every closure call)."""
    torch.manual_seed(0)
    vgg = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
    content = torch.randn(1, 3, 8, 8)
    image = torch.randn(1, 3, 8, 8).requires_grad_(True)  # the tutorial's other start: white noise
    optimizer = torch.optim.LBFGS([image], max_iter=3)
    target = vgg(content).detach()
    line = 0
    with findings() as got:
        for _ in range(4):
            def closure() -> torch.Tensor:
                nonlocal line
                optimizer.zero_grad()
                loss = F.mse_loss(vgg(image), target)
                loss.backward(); line = lineno()  # noqa: E702
                return loss

            optimizer.step(closure)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GradientsNobodyUsesWarning, __file__, line)]
    assert "computes gradients for vgg (a Sequential, 4 parameters" in str(got[0].message)


def test_an_encoder_given_to_the_optimizer_at_the_third_step_is_silent() -> None:
    """Progressive unfreezing: the head is trained first, the encoder is added with add_param_group at step 3 (its
    page lists this as silent); the backbone left out for good is still found, once it stayed out for 8 steps."""
    def run(add_at: int | None, steps: int) -> list[warnings.WarningMessage]:
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("encoder", nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
        model.add_module("head", nn.Linear(8, 2))
        opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        with findings() as got:
            for step in range(steps):
                if step == add_at:
                    opt.add_param_group({"params": model.encoder.parameters(), "lr": 0.01})
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        return got

    assert run(add_at=3, steps=12) == []
    gradients_nobody_uses.reset()
    left_out = run(add_at=None, steps=12)
    assert [w.category for w in left_out] == [GradientsNobodyUsesWarning]
    assert "computes gradients for model.encoder (a Sequential" in str(left_out[0].message)
