"""ST003: eval-mode forwards run under no_grad, and every legitimate pattern keeps its gradients."""

from __future__ import annotations

import copy
import io
import pickle
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import EvalModeGradWarning, SafetorchError

from .conftest import findings, lineno, run_python


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 4))


def saved_bytes(fn: object) -> int:
    """Bytes of tensors autograd saves for backward while running fn(): what a validation pass keeps alive."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return total[0]


def test_eval_forward_runs_under_no_grad_and_warns_at_this_line() -> None:
    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8)
    with findings() as got:
        score = model(x); line = lineno()  # noqa: E702
    assert not score.requires_grad and score.grad_fn is None
    assert torch.is_grad_enabled()  # restored after the forward
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EvalModeGradWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST003 model (Sequential) is in eval mode with autograd on")
    assert "Write: `with torch.no_grad():`" in message


def test_outputs_are_the_same_numbers() -> None:
    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = model(x)
    assert torch.equal(model(x), expected)


def test_validation_pass_saves_nothing_for_backward() -> None:
    model = convnet().eval()
    x = torch.randn(8, 3, 32, 32)
    with_safetorch = saved_bytes(lambda: model(x))
    safetorch.uninstall()
    without = saved_bytes(lambda: model(x))
    assert with_safetorch == 0
    assert without > 8 * 16 * 32 * 32 * 4  # at least one conv activation


def test_once_per_call_site_but_every_forward_is_protected() -> None:
    model = convnet().eval()
    with findings() as got:
        outs = [model(torch.randn(1, 3, 8, 8)) for _ in range(3)]
    assert len(got) == 1
    assert not any(o.requires_grad for o in outs)


def test_perceptual_loss_through_a_frozen_eval_net_keeps_generator_gradients() -> None:
    generator = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1))
    features = convnet()[:5].eval()
    for p in features.parameters():
        p.requires_grad_(False)
    target = torch.randn(2, 3, 8, 8)
    with findings() as got:
        fake = generator(torch.randn(2, 3, 8, 8))
        loss = nn.functional.mse_loss(features(fake), features(target))
        loss.backward()
    assert got == []
    assert generator[0].weight.grad is not None and generator[0].weight.grad.abs().sum() > 0


def test_perceptual_loss_through_an_unfrozen_eval_net_still_reaches_the_generator() -> None:
    generator = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1))
    features = convnet()[:5].eval()
    fake = generator(torch.randn(2, 3, 8, 8))
    with findings() as got:
        loss = nn.functional.mse_loss(features(fake), torch.zeros(2, 16, 8, 8))
    loss.backward()
    assert got == []  # the input requires grad: untouched
    assert generator[0].weight.grad.abs().sum() > 0


def test_gradient_with_respect_to_the_input_of_an_eval_model() -> None:
    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with findings() as got:
        model(x)[:, 1].sum().backward()
    assert got == []
    assert x.grad is not None and x.grad.abs().sum() > 0
    # inputs in a list, a tuple or a dict count too
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, pair: list[torch.Tensor], extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
            return self.lin(pair[0] + pair[1] + (extra or {}).get("z", 0))

    pair = Pair().eval()
    a = torch.randn(2, 3, requires_grad=True)
    assert pair([torch.zeros(2, 3), a]).requires_grad
    assert pair([torch.zeros(2, 3), torch.zeros(2, 3)], extra={"z": a}).requires_grad


def test_frozen_batchnorm_first_layer_in_a_training_net_gets_gradients() -> None:
    net = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    net.train()
    net[0].eval()  # frozen statistics; its affine weights still train
    with findings() as got:
        net(torch.randn(4, 3, 8, 8)).sum().backward()
    assert got == []
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum() > 0
    assert net[0].bias.grad is not None


def test_explicit_enable_grad_opts_out() -> None:
    model = convnet().eval()
    x = torch.randn(1, 3, 8, 8)
    with findings() as got:
        with torch.enable_grad():
            assert model(x).requires_grad
        with torch.set_grad_enabled(True):
            assert model(x).requires_grad

        @torch.enable_grad()
        def decorated() -> torch.Tensor:
            return model(x)

        assert decorated().requires_grad
    assert got == []
    with torch.no_grad():  # torch's own restore of grad mode is not an explicit request
        pass
    with torch.set_grad_enabled(False):
        pass
    with findings() as got:
        assert not model(x).requires_grad
    assert len(got) == 1


def test_set_grad_enabled_true_as_a_function_opts_the_thread_out() -> None:
    model = convnet().eval()
    x = torch.randn(1, 3, 8, 8)
    torch.set_grad_enabled(False)
    try:
        assert not model(x).requires_grad
        torch.set_grad_enabled(True)
        with findings() as got:
            assert model(x).requires_grad
        assert got == []
    finally:
        from safetorch.checks import eval_mode_grad

        eval_mode_grad._state.explicit = False  # this thread is the test runner's: leave it as it was


def test_nothing_to_save_nothing_to_report() -> None:
    model = convnet().eval().requires_grad_(False)
    with findings() as got:
        out = model(torch.randn(1, 3, 8, 8))
    assert got == [] and not out.requires_grad


def test_training_models_carry_no_hooks_and_are_untouched() -> None:
    model = convnet()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    with findings() as got:
        assert model(torch.randn(2, 3, 8, 8)).requires_grad
    assert got == []


def test_nested_eval_modules_report_once_at_the_top_level_call() -> None:
    outer = nn.Sequential(convnet(), nn.Linear(4, 2)).eval()
    with findings() as got:
        outer(torch.randn(1, 3, 8, 8)); line = lineno()  # noqa: E702
    assert [w.lineno for w in got] == [line]


def test_training_through_an_eval_forward_fails_with_a_clear_error() -> None:
    model = convnet().eval()
    out = model(torch.randn(2, 3, 8, 8))
    with pytest.raises(SafetorchError) as info:
        out.sum().backward()
    message = str(info.value)
    assert message.startswith("ST003 backward() failed: element 0 of tensors does not require grad")
    for part in ("model (Sequential)", "under torch.no_grad()", "model.train()", "with torch.enable_grad():",
                 "SAFETORCH_IGNORE=ST003"):
        assert part in message
    assert isinstance(info.value, RuntimeError) and isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(SafetorchError):
        torch.autograd.backward(out.sum())


def test_strict_mode_raises_on_this_line() -> None:
    safetorch.install(strict=True)
    model = convnet().eval()
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        model(torch.randn(1, 3, 8, 8))
    assert (info.value.code, info.value.filename, info.value.lineno) == ("ST003", __file__, line)
    assert torch.is_grad_enabled()


def test_grad_mode_is_restored_when_the_forward_raises() -> None:
    model = convnet().eval()
    with pytest.raises(RuntimeError):
        model(torch.randn(1, 5, 8, 8))  # wrong channel count
    assert torch.is_grad_enabled()


def test_toggling_eval_and_train_leaks_nothing() -> None:
    model = convnet()
    for _ in range(2000):
        model.eval()
        model.train()
    for m in model.modules():
        for table in (m._forward_pre_hooks, m._forward_hooks, m._forward_hooks_with_kwargs,
                      m._forward_pre_hooks_with_kwargs, m._forward_hooks_always_called):
            assert len(table) == 0
    model.eval()
    model.eval()
    # the module the program put in eval mode carries the hooks; its children run inside its forward
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == (1, 1)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in list(model.modules())[1:])
    model[0].eval()  # a submodule put in eval mode by the program itself is checked when called directly
    assert len(model[0]._forward_pre_hooks) == 1
    model.train()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_state_dict_pickle_deepcopy_and_save_are_unchanged() -> None:
    model = convnet()
    keys = list(model.state_dict())
    model.eval()
    assert list(model.state_dict()) == keys
    data = pickle.dumps(model)
    assert b"safetorch" not in data
    again = pickle.loads(data)
    x = torch.randn(1, 3, 8, 8)
    assert torch.equal(again(x), model(x))
    ema = copy.deepcopy(model)
    with findings() as got:
        assert not ema(x).requires_grad  # the copy keeps the check
    assert len(got) == 1
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), model(x))
    loaded.train()
    loaded.eval()  # relics of the round trip are replaced, not stacked
    assert len(loaded._forward_pre_hooks) == 1


def test_a_model_saved_with_safetorch_loads_without_it(tmp_path: object) -> None:
    path = f"{tmp_path}/model.pt"
    model = convnet().eval()
    torch.save(model, path)
    proc = run_python(f"import torch, sys; m = torch.load({path!r}, weights_only=False); "
                      "print(m(torch.randn(1, 3, 8, 8)).shape, 'safetorch' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch.Size([1, 4]) False"


def test_uninstall_takes_the_hooks_off() -> None:
    model = convnet().eval()
    safetorch.uninstall()
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert model(torch.randn(1, 3, 8, 8)).requires_grad


def test_threads_keep_their_own_grad_mode() -> None:
    evaluated = convnet().eval()
    trained = convnet()
    errors: list[str] = []

    def evaluate() -> None:
        for _ in range(200):
            if evaluated(torch.randn(1, 3, 8, 8)).requires_grad:
                errors.append("eval output requires grad")

    def train() -> None:
        for _ in range(200):
            with torch.enable_grad():
                if not evaluated(torch.randn(1, 3, 8, 8)).requires_grad:
                    errors.append("explicit enable_grad lost in a thread")
            if not trained(torch.randn(1, 3, 8, 8)).requires_grad:
                errors.append("training output lost its graph")

    threads = [threading.Thread(target=f) for f in (evaluate, train, evaluate, train)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert torch.is_grad_enabled()


def test_transforms_keep_working() -> None:
    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = model(x)
    assert torch.allclose(torch.jit.script(model)(x), expected)
    assert torch.allclose(torch.jit.trace(model, x)(x), expected)
    assert torch.allclose(torch.fx.symbolic_trace(model)(x), expected)
    assert torch.allclose(torch.export.export(model, (x,)).module()(x), expected)
    assert torch.allclose(nn.DataParallel(model)(x), expected)
    scripted = torch.jit.script(convnet())
    with findings() as got:
        scripted.eval()
    assert got == []
    assert _has_ours_count(model) == 1


def _has_ours_count(model: nn.Module) -> int:
    from safetorch.checks.eval_mode_grad import _has_ours

    return sum(_has_ours(m) for m in model.modules())


def test_torch_compile_sees_no_new_graph_break() -> None:
    import torch._dynamo

    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8)
    torch._dynamo.reset()
    ours = torch._dynamo.explain(model)(x)
    safetorch.uninstall()
    torch._dynamo.reset()
    theirs = torch._dynamo.explain(model)(x)
    assert ours.graph_break_count == theirs.graph_break_count == 0
    safetorch.install()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.allclose(compiled(x), model(x))


def test_an_interrupted_eval_forward_is_healed_by_train() -> None:
    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt  # the user presses Ctrl-C during validation

    model = Slow().eval()
    with pytest.raises(KeyboardInterrupt):
        model(torch.ones(1, 2))
    model.train()
    assert torch.is_grad_enabled()
    assert model.lin(torch.ones(1, 2)).requires_grad


def _hooked(model: nn.Module) -> bool:
    from safetorch.checks.eval_mode_grad import _has_ours

    return _has_ours(model)


@pytest.fixture(autouse=True)
def _threads_of_this_test_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count only the threads a test starts: earlier tests leave daemon threads (multiprocessing's resource
    sharer) for the life of the runner, with which the hooks would, rightly, never park."""
    import _thread

    from safetorch.checks import eval_mode_grad

    before = _thread._count()
    monkeypatch.setattr(eval_mode_grad, "_other_threads", lambda: _thread._count() - before)


def test_validation_under_no_grad_takes_torchs_fast_path() -> None:
    """Under no_grad in the only thread the hooks are parked: a validation forward pays nothing for ST003."""
    model = convnet().eval()
    assert _hooked(model)
    with torch.no_grad():
        assert not _hooked(model) and not model._forward_pre_hooks and not model._forward_hooks
        model(torch.randn(1, 3, 8, 8))
    assert _hooked(model)
    with findings() as got:
        out = model(torch.randn(1, 3, 8, 8)); line = lineno()  # noqa: E702
    assert not out.requires_grad
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]


def test_eval_called_under_no_grad_is_checked_once_grad_is_back() -> None:
    model = convnet()
    with torch.no_grad():
        model.eval()
        assert not _hooked(model)
    with findings() as got:
        out = model(torch.randn(1, 3, 8, 8)); line = lineno()  # noqa: E702
    assert not out.requires_grad and torch.is_grad_enabled()
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]


@pytest.mark.parametrize("switch_off", ["no_grad", "set_grad_enabled", "decorator"])
def test_every_python_way_of_switching_grad_off_and_on_parks_and_unparks(switch_off: str) -> None:
    model = convnet().eval()
    seen: list[bool] = []

    @torch.no_grad()
    def decorated() -> None:
        seen.append(_hooked(model))

    if switch_off == "no_grad":
        with torch.no_grad():
            seen.append(_hooked(model))
    elif switch_off == "set_grad_enabled":
        with torch.set_grad_enabled(False):
            seen.append(_hooked(model))
            with torch.enable_grad():
                seen.append(_hooked(model))
            seen.append(_hooked(model))
        torch.set_grad_enabled(False)
        seen.append(_hooked(model))
        torch.set_grad_enabled(True)
        from safetorch.checks import eval_mode_grad

        eval_mode_grad._state.explicit = False  # the function form opted the runner's thread out: undo that
    else:
        decorated()
    seen.append(_hooked(model))
    expected = {"no_grad": [False, True], "set_grad_enabled": [False, True, False, False, True],
                "decorator": [False, True]}
    assert seen == expected[switch_off]


def test_with_another_thread_alive_the_hooks_stay_on() -> None:
    model = convnet().eval()
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        with torch.no_grad():
            assert _hooked(model)  # that thread's grad mode is its own: it may call the model with grad on
    finally:
        release.set()
        other.join()
    with torch.no_grad():
        assert not _hooked(model)


class _NoGradInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # a module that switches grad off inside its own forward
            scale = x.abs().mean()
        return self.body(x) * scale


def test_a_no_grad_block_inside_our_no_grad_forward_does_not_lose_grad_mode() -> None:
    model = _NoGradInside().eval()
    with findings() as got:
        out = model(torch.randn(2, 4)); line = lineno()  # noqa: E702
    assert not out.requires_grad
    assert torch.is_grad_enabled()  # restored by our hook, which a park in the inner block must not remove
    assert _hooked(model)
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]


def test_frozen_eval_submodule_stays_checked_across_optimizer_steps() -> None:
    """An optimizer step switches grad off and on again: the frozen eval-mode net is parked and unparked with it."""
    torch.manual_seed(0)
    frozen = nn.Linear(4, 4).eval()
    student = nn.Linear(4, 4)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    for _ in range(3):
        loss = (student(torch.randn(2, 4)) - frozen(torch.randn(2, 4)).detach()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert _hooked(frozen) and torch.is_grad_enabled()
    assert student.weight.grad is not None


def test_inference_mode_parks_the_hooks_too() -> None:
    model = convnet().eval()
    with torch.inference_mode():
        assert not _hooked(model)
        out = model(torch.randn(1, 3, 8, 8))
    assert out.is_inference() and _hooked(model)
    with findings() as got:
        assert not model(torch.randn(1, 3, 8, 8)).requires_grad; line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]


def test_scripting_a_parked_model_leaves_it_parked_until_grad_comes_back() -> None:
    model = convnet().eval()
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's own deprecation notices
            scripted = torch.jit.script(model)
        assert not _hooked(model)
        assert torch.allclose(scripted(torch.ones(1, 3, 8, 8)), model(torch.ones(1, 3, 8, 8)))
    assert _hooked(model)
