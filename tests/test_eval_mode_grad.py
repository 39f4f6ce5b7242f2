"""ST003 and ST008: an eval-mode forward is watched first, then run under no_grad only where nothing needed its graph.

Every correct program below trains or evaluates exactly as without safetorch (bit-identical numbers); the pitfalls
are reported at the user's line.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import fakehub  # tests/site-packages: a library, put on the path by conftest
import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import EvalModeGradWarning, EvalModeTrainingWarning, GraphAccumulationWarning, SafetorchError
from safetorch.checks import eval_mode_grad

from .conftest import findings, lineno, run_python


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 4))


def both(program: Callable[[], Any]) -> tuple[Any, Any]:
    """The program's result with safetorch installed, and again uninstalled (each run starts from fresh seeds)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on = program()
        safetorch.uninstall()
        try:
            off = program()
        finally:
            safetorch.install()
    return on, off


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def keeps_activations(call: Callable[[], Any]) -> tuple[Any, bool]:
    """The call's result, and whether its forward kept activations for a backward — what a validation loop without
    no_grad keeps alive and what runs a GPU out of memory. A forward ST003's act runs keeps none (it runs under
    no_grad, so these hooks see nothing)."""
    packed: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(1)
        return t.detach()  # no cycle through a saved output's own grad_fn: its graph dies by reference counting

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    return out, bool(packed)


def guarded(model: nn.Module) -> bool:
    return isinstance(model.__dict__.get("_call_impl"), eval_mode_grad._Guard)


# --- the pitfall: a validation loop without no_grad --------------------------------------------------------------


def test_validation_loop_is_watched_once_then_keeps_no_activations() -> None:
    model = convnet().eval()
    kept, grads = [], []
    with findings() as got:
        for _ in range(4):
            score, k = keeps_activations(lambda: model(torch.randn(2, 3, 8, 8))); line = lineno()  # noqa: E702
            kept.append(k)
            grads.append(score.requires_grad)
    assert kept == [True, False, False, False]  # the first forward runs as written; the next ones as the act
    assert grads == [True] * 4  # as written: each output still has a graph (a backward would recompute)
    assert torch.is_grad_enabled()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EvalModeGradWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST003 model (Sequential) is in eval mode with autograd on")
    assert "Write: `with torch.no_grad():`" in message and "watched the first forward" in message
    assert "saw its graph die unused" in message


def test_the_decision_waits_while_the_watched_graph_is_alive() -> None:
    """A rollout buffer keeps every output: the watched graph is alive, nothing is decided and nothing reported; the
    forwards after the first keep no activations, and the loss over the buffer gets every gradient."""

    def program() -> Any:
        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).eval()
        buffer = [policy(torch.randn(3, 4)).log_softmax(-1)[:, 0] for _ in range(5)]
        torch.stack(buffer).sum().backward()
        return [p.grad for p in policy.parameters()]

    with findings() as got:
        on, off = both(program)
        program()
    assert got == [] and same(on, off)


def test_a_rollout_longer_than_the_forwards_that_hold_their_inputs_gets_every_gradient() -> None:
    """The same rollout buffer over 8 steps (an episode longer than the `HELD` forwards that keep their inputs while
    the site is undecided), each step's observation dropped once acted on, as REINFORCE writes it. The watched graph
    is alive the whole time: nothing is decided, and the backward must get the gradients of the program as written,
    not a SafetorchError saying the first forward's graph "died unused"."""

    def program() -> Any:
        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).eval()
        buffer = [policy(torch.randn(3, 4)).log_softmax(-1)[:, 0] for _ in range(8)]
        torch.stack(buffer).sum().backward()
        return [p.grad for p in policy.parameters()]

    with findings() as got:
        on, off = both(program)
        program()
    assert got == [] and same(on, off)


def test_a_policy_that_samples_in_its_forward_gets_the_gradients_of_its_own_samples() -> None:
    """An eval-mode policy whose forward samples its action (``Categorical(logits).sample()``) and returns its
    log-probability, kept for a REINFORCE loss: eval mode is not deterministic here. A recomputation for the backward
    must see the same random numbers as the forward (the action that was taken), and must not move the program's
    random stream: the gradients and the next random number are those of the program without safetorch."""

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 8)

        def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            dist = torch.distributions.Categorical(logits=self.net(obs))
            action = dist.sample()
            return action, dist.log_prob(action)

    def program() -> Any:
        torch.manual_seed(0)
        policy = Policy().eval()
        observations = [torch.randn(4) for _ in range(3)]
        steps = [policy(obs) for obs in observations]
        (-torch.stack([lp for _, lp in steps]).sum()).backward()
        return [a for a, _ in steps], [p.grad for p in policy.parameters()], torch.rand(3)

    with findings() as got:
        on, off = both(program)
        program()
    assert got == []
    assert same(on[0], off[0])  # the actions taken
    assert same(on[1], off[1])  # the gradients of their log-probabilities
    assert same(on[2], off[2])  # the random stream after the backward


def test_outputs_are_those_of_the_same_program_with_no_grad() -> None:
    model = convnet().eval()
    xs = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    with torch.no_grad():
        expected = [model(x) for x in xs]
    with findings():
        got = [model(x) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_strict_mode_raises_at_the_second_forward_on_this_line() -> None:
    safetorch.install(strict=True)
    model = convnet().eval()
    with pytest.raises(SafetorchError) as info:
        for _ in range(2):
            model(torch.randn(1, 3, 8, 8)); line = lineno()  # noqa: E702
    assert (info.value.code, info.value.filename, info.value.lineno) == ("ST003", __file__, line)
    assert torch.is_grad_enabled()


def test_a_warning_filter_set_to_error_raises_the_finding_at_this_line() -> None:
    model = convnet().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvalModeGradWarning)
        with pytest.raises(EvalModeGradWarning) as info:
            for _ in range(2):
                model(torch.randn(1, 3, 8, 8)); line = lineno()  # noqa: E702
    assert str(info.value).startswith("ST003 model (Sequential)")
    assert any(entry.lineno + 1 == line and str(entry.path) == __file__ for entry in info.traceback)
    assert torch.is_grad_enabled()


def test_a_site_where_nothing_can_record_is_left_alone() -> None:
    model = convnet().eval().requires_grad_(False)
    with findings() as got:
        outs = [model(torch.randn(1, 3, 8, 8)) for _ in range(3)]
    assert got == [] and not any(o.requires_grad for o in outs)


# --- issue #13's table: correct programs that must run as without safetorch -------------------------------------


def _fine_tune(make: Callable[[], nn.Module], steps: int = 4) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return weights(model), losses


def test_from_pretrained_model_fine_tuned_without_train_runs_and_gets_st008() -> None:
    with findings() as got:
        model = fakehub.from_pretrained()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            out = model(torch.randn(8, 6)); line = lineno()  # noqa: E702
            loss = nn.functional.cross_entropy(out, torch.randint(0, 3, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EvalModeTrainingWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST008 model (TinyClassifier) is trained in eval mode")
    assert (f"put in eval mode by `model = fakehub.from_pretrained()` at {__file__}:{line - 3}, in "
            f"fakehub.from_pretrained() at {fakehub.__file__}:{fakehub.EVAL_LINE}") in message
    assert "Write: model.train() before the training loop" in message and "SAFETORCH_IGNORE=ST008" in message
    on, off = both(lambda: _fine_tune(fakehub.from_pretrained))
    assert same(on, off)


def test_st008_names_the_users_own_eval_line_after_a_validation() -> None:
    """The forgotten model.train() after validation: the program's eval(), an evaluation, then training."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with findings() as got:
        model.eval(); eval_line = lineno()  # noqa: E702
        with torch.no_grad():
            model(torch.randn(4, 3))
        for _ in range(2):
            loss = model(torch.randn(4, 3)).sum(); line = lineno()  # noqa: E702
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(w.category, w.lineno) for w in got] == [(EvalModeTrainingWarning, line)]
    assert (f"`model.eval(); eval_line = lineno()  # noqa: E702` at {__file__}:{eval_line} in "
            f"tests.test_eval_mode_grad.test_st008_names_the_users_own_eval_line_after_a_validation()") in str(
        got[0].message)


class _Noisy(nn.Module):
    """A block of the program's own whose forward reads ``self.training``: noise while training."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (torch.randn_like(x) if self.training else 0)


class _OwnDropout(nn.Module):
    """Functional dropout tied to the mode: no dropout module, yet eval mode switches it off."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.lin(x), 0.2, training=self.training)


def _forgotten_train(make: Callable[[], nn.Module]) -> tuple[Any, list[float], int]:
    """The forgotten model.train() after validation: eval(), an evaluation under no_grad, then training steps. The
    weights, the losses, and the training forward's line."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 3))
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 3)).pow(2).mean(); line = lineno()  # noqa: E702
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return weights(model), losses, line


@pytest.mark.parametrize(("make", "effects"), [
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Dropout(0.2), nn.Linear(4, 3)),
     "dropout is off and BatchNorm uses its running statistics"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.LayerNorm(4)), "dropout is off"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), "BatchNorm uses its running statistics"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.InstanceNorm1d(4, track_running_stats=True)),
     "InstanceNorm uses its running statistics"),
    (lambda: nn.Sequential(_Noisy(), nn.ReLU()), "_Noisy reads self.training"),
    (_OwnDropout, "_OwnDropout reads self.training"),
], ids=["dropout-and-batchnorm", "dropout", "batchnorm", "instancenorm-with-statistics", "own-block", "F.dropout"])
def test_st008_names_only_what_eval_mode_changes_in_this_model(make: Callable[[], nn.Module], effects: str) -> None:
    with findings() as got:
        on = _forgotten_train(make)
    line = on[2]
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EvalModeTrainingWarning, __file__, line)]
    assert str(got[0].message).startswith(
        f"ST008 model ({type(make()).__name__}) is trained in eval mode: an optimizer updates its parameters, but "
        f"{effects}. It was put in eval mode by `model.eval()` at {__file__}:")
    safetorch.uninstall()
    try:
        off = _forgotten_train(make)
    finally:
        safetorch.install()
    assert same(on, off)


@pytest.mark.parametrize("make", [
    lambda: nn.Linear(3, 3),
    lambda: nn.Sequential(nn.Linear(3, 8), nn.GELU(), nn.LayerNorm(8), nn.Dropout(0.0), nn.Linear(8, 3)),
    lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.InstanceNorm1d(4),
                          nn.Linear(4, 3)),
], ids=["linear", "no-active-dropout", "norms-without-statistics"])
def test_st008_is_silent_for_a_model_whose_numbers_eval_mode_does_not_change(make: Callable[[], nn.Module]) -> None:
    """Nothing in the model reads the mode (no dropout, no running statistics, no block of its own that reads
    self.training): trained in eval mode it computes exactly what it would in training mode. A program that prints
    the same numbers either way gets no finding; one that adds a dropout or a BatchNorm later does."""
    with findings() as got:
        on = _forgotten_train(make)
    assert got == []
    safetorch.uninstall()
    try:
        off = _forgotten_train(make)
    finally:
        safetorch.install()
    assert same(on, off)
    model = make()
    torch.manual_seed(0)
    in_train_mode = [model.train()(x) for x in torch.randn(2, 4, 3)]
    torch.manual_seed(0)
    assert same(in_train_mode, [model.eval()(x) for x in torch.randn(2, 4, 3)])  # eval mode changes nothing


def test_the_programs_own_eval_followed_straight_by_training_is_a_choice() -> None:
    """``backbone.eval()`` before the loop freezes BatchNorm on purpose: ST008's fix, train(), would undo it."""

    def program() -> Any:
        torch.manual_seed(0)
        backbone = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        backbone.eval()
        opt = torch.optim.SGD(backbone.parameters(), lr=0.1)
        for _ in range(3):
            loss = backbone(torch.randn(5, 3)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return weights(backbone)

    with findings() as got:
        on, off = both(program)
        program()
    assert got == [] and same(on, off)


class _Wrapper(nn.Module):
    """A new parent in training mode around a loaded model, as ``get_peft_model`` builds one."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.adapter = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.adapter(x.mean(-1, keepdim=True).expand(-1, 3))


def test_a_loaded_model_wrapped_in_a_new_parent_and_trained_without_train_gets_st008() -> None:
    """``model = get_peft_model(AutoModel.from_pretrained(d), cfg)`` trained without model.train(): the base runs with
    dropout off, first called inside its training wrapper."""
    with findings() as got:
        model = _Wrapper(fakehub.from_pretrained()); load = lineno()  # noqa: E702
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.randn(8, 6)).logsumexp(-1).mean(); line = lineno()  # noqa: E702
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EvalModeTrainingWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST008 model (TinyClassifier) is trained in eval mode")
    assert (f"put in eval mode by `model = _Wrapper(fakehub.from_pretrained()); load = lineno()  # noqa: E702` at "
            f"{__file__}:{load}, in fakehub.from_pretrained() at {fakehub.__file__}:{fakehub.EVAL_LINE}") in message
    assert "Write: model.train() before the training loop" in message


def test_new_head_on_a_from_pretrained_backbone_trains_the_backbone() -> None:
    def program() -> Any:
        backbone = fakehub.from_pretrained().encoder
        head = nn.Linear(16, 2)
        opt = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.1)
        torch.manual_seed(2)
        grads = []
        for _ in range(3):
            loss = head(backbone(torch.randn(4, 6))).logsumexp(1).mean()
            opt.zero_grad()
            loss.backward()
            grads.append(backbone[0].weight.grad.clone())
            opt.step()
        return weights(backbone), grads

    on, off = both(program)
    assert same(on, off) and all(g.abs().sum() > 0 for g in on[1])


def test_a_module_that_puts_its_backbone_in_eval_mode_in_init_trains_it() -> None:
    def program() -> Any:
        net = fakehub.FrozenBackboneNet()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        torch.manual_seed(3)
        for _ in range(3):
            loss = net(torch.randn(4, 6)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return weights(net), net.backbone[0].weight.grad

    with findings() as got:
        on, off = both(program)
    assert got == []  # the backbone is called inside its training parent: not a top-level eval forward
    assert same(on, off) and on[1] is not None and on[1].abs().sum() > 0
    net = fakehub.FrozenBackboneNet()
    net(torch.randn(1, 6))
    assert not guarded(net.backbone)  # a child called by its parent loses the guard at that first call


def test_a_model_saved_after_evaluation_holds_the_same_bytes_and_loads_anywhere(tmp_path: Any) -> None:
    """pytorch/examples word_language_model: evaluate(); torch.save(model, f); later torch.load(f)."""

    def saved() -> tuple[bytes, bytes]:
        model = convnet()
        model.eval()
        for _ in range(3):
            model(torch.randn(1, 3, 8, 8))  # evaluate() without no_grad
        whole, state = io.BytesIO(), io.BytesIO()
        torch.save(model, whole)
        torch.save(model.state_dict(), state)
        return whole.getvalue(), state.getvalue()

    on, off = both(saved)
    assert on == off  # byte for byte: no trace of safetorch
    model = convnet().eval()
    with findings():
        for _ in range(3):
            model(torch.randn(1, 3, 8, 8))
    assert guarded(model)
    with_guard = pickle.dumps(model)
    safetorch.uninstall()
    assert not guarded(model) and pickle.dumps(model) == with_guard
    safetorch.install()
    path = f"{tmp_path}/model.pt"
    with open(path, "wb") as fh:
        fh.write(on[0])
    with open(f"{tmp_path}/state.pt", "wb") as fh:
        fh.write(on[1])
    proc = run_python(
        "import sys, torch\n"
        f"m = torch.load({path!r}, weights_only=False)\n"
        f"sd = torch.load({str(tmp_path) + '/state.pt'!r})\n"  # torch's default: weights_only=True
        "x = torch.randn(1, 3, 8, 8)\n"
        "assert not m._forward_pre_hooks and not m._forward_hooks and '_call_impl' not in vars(m)\n"
        "s = torch.jit.script(m)\n"
        "c = torch.compile(m, backend='eager', fullgraph=True)\n"
        "print(len(sd), torch.allclose(s(x), m(x)), torch.allclose(c(x), m(x)), 'safetorch' in sys.modules)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["11", "True", "True", "False"]


def test_loading_and_unpickling_under_safetorch_gives_an_unguarded_copy() -> None:
    model = convnet().eval()
    assert guarded(model)
    again = pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not guarded(again) and not guarded(loaded) and not guarded(copy.copy(model))
    x = torch.randn(1, 3, 8, 8)
    assert torch.equal(again(x), loaded(x))


def test_a_library_calling_set_grad_enabled_as_a_function_leaves_st003_on() -> None:
    """Lightning's fit loop calls torch.set_grad_enabled(True) as a function; that is no scope and no opt-out."""
    torch.set_grad_enabled(False)
    torch.set_grad_enabled(True)
    model = convnet().eval()
    with findings() as got:
        kept = [keeps_activations(lambda: model(torch.randn(1, 3, 8, 8)))[1] for _ in range(2)]
    assert kept == [True, False]
    assert [w.category for w in got] == [EvalModeGradWarning]


def entered_safetorch(call: Callable[[], Any]) -> list[str]:
    """The names of safetorch's functions that ``call`` enters (a profiler's count)."""
    own, entered = safetorch.__file__.rsplit("/", 1)[0], []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(own):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


def torchs_set_grad_enabled() -> bool:
    return "__init__" in vars(torch.set_grad_enabled) and torch.set_grad_enabled.__init__ is eval_mode_grad._torch_init


@pytest.mark.python
def test_an_evaluation_enters_safetorch_at_its_first_forward_only_and_the_guard_is_back_after_it() -> None:
    """Under no_grad the guard has nothing to do: it stands aside after the evaluation's first forward, and is back
    (with torch's ``set_grad_enabled`` untouched) once the scope ends. A validation loop without no_grad after it is
    still ST003's finding, at its line."""
    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8)
    outs: list[torch.Tensor] = []

    def evaluate() -> None:
        with torch.no_grad():
            outs.extend(model(x) for _ in range(5))

    entered = entered_safetorch(evaluate)
    assert entered.count("__call__") == 1 and "_step_aside" in entered and "_rearm" in entered
    assert len(entered) < 12  # the first forward, the step aside, and the scope's end: nothing per forward
    assert guarded(model) and torchs_set_grad_enabled() and torch.is_grad_enabled()
    assert all(not o.requires_grad and torch.equal(o, outs[0]) for o in outs)
    with findings() as got:
        for _ in range(3):
            model(x); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EvalModeGradWarning, __file__, line)]


@pytest.mark.python
@pytest.mark.parametrize("scope", ["no_grad decorator", "set_grad_enabled(False) scope", "function form",
                                   "inference_mode", "inference_mode decorator", "nested no_grad"])
def test_every_way_out_of_an_evaluation_puts_the_guard_back(scope: str) -> None:
    """However grad mode went off and comes back, the guard is back in its module when it does, and the loop without
    no_grad that follows is reported."""
    model = convnet().eval()
    x = torch.randn(1, 3, 8, 8)

    def forwards() -> None:
        for _ in range(3):
            model(x)

    if scope == "no_grad decorator":
        torch.no_grad()(forwards)()
    elif scope == "set_grad_enabled(False) scope":
        with torch.set_grad_enabled(False):
            forwards()
    elif scope == "function form":  # Lightning's loops switch it this way
        torch.set_grad_enabled(False)
        forwards()
        assert not guarded(model)
        torch.set_grad_enabled(True)
    elif scope == "inference_mode":
        with torch.inference_mode():
            forwards()
    elif scope == "inference_mode decorator":
        torch.inference_mode()(forwards)()
    else:  # a metric under its own no_grad inside the evaluation: the guard stays aside until grad mode is back
        with torch.no_grad():
            forwards()
            with torch.no_grad():
                pass
            assert not guarded(model)
            forwards()
    assert guarded(model) and torchs_set_grad_enabled() and torch.is_grad_enabled()
    with findings() as got:
        for _ in range(3):
            model(x); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]


def test_grad_mode_switched_on_inside_an_evaluation_finds_the_guard_back() -> None:
    """A forward with autograd on inside the evaluation's scope (``torch.set_grad_enabled(True)`` as a function) is
    watched as any other; an explicit ``enable_grad`` scope stays the opt-out it is."""
    model = convnet().eval()
    x = torch.randn(1, 3, 8, 8)
    with findings() as got, torch.no_grad():
        model(x)
        with torch.enable_grad():
            assert all(model(x).requires_grad for _ in range(3))
        model(x)  # the scope's end put the guard back; under no_grad again it stands aside
        assert not guarded(model)
        torch.set_grad_enabled(True)
        try:
            kept = [keeps_activations(lambda: model(x))[1] for _ in range(3)]; line = lineno()  # noqa: E702
        finally:
            torch.set_grad_enabled(False)
        model(x)
    assert kept == [True, False, False]
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]
    assert guarded(model) and torchs_set_grad_enabled()


def test_train_deepcopy_and_uninstall_during_an_evaluation_find_the_guard_back() -> None:
    model = convnet().eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        model(x)
        assert not guarded(model)
        twin = copy.deepcopy(model)  # the copy gets a guard of its own, as outside an evaluation
        assert guarded(twin) and twin.__dict__["_call_impl"] is not model.__dict__["_call_impl"]
        model(x)
        model.train()  # the guard is back and taken off by train(); eval() puts it on again
        assert not guarded(model) and model.training
        model.eval()
        model(x)
        assert not guarded(model)
        safetorch.uninstall()
        try:
            assert torchs_set_grad_enabled() and not guarded(model)
            model(x)
        finally:
            safetorch.install()
    assert not guarded(model) and torchs_set_grad_enabled()


def test_a_guard_that_stood_aside_inside_st003s_own_act_is_back_after_it() -> None:
    """The act runs its forward under no_grad and gives grad mode back by itself: a BatchNorm the program puts in eval
    mode on its own before each forward (its own guard) stands aside inside that forward and is back after it."""
    model = convnet().eval()
    bn, x = model[1], torch.randn(1, 3, 8, 8)
    kept = []
    with findings() as got:
        for _ in range(3):
            bn.eval()
            kept.append(keeps_activations(lambda: model(x))[1])
    assert kept == [True, False, False] and [w.category for w in got] == [EvalModeGradWarning]
    assert guarded(model) and guarded(bn) and torchs_set_grad_enabled() and not eval_mode_grad._aside


@pytest.mark.python
def test_torchs_own_error_from_set_grad_enabled_during_an_evaluation_shows_no_safetorch_frame() -> None:
    model = convnet().eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 8, 8))
        assert not torchs_set_grad_enabled()
        with pytest.raises(TypeError) as raised:
            torch.set_grad_enabled("yes")  # type: ignore[arg-type]
        own = safetorch.__file__.rsplit("/", 1)[0]
        files = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
        assert files[0] == __file__ and files[-1].endswith("grad_mode.py")
        if sys.version_info >= (3, 11):  # on 3.10 a bare `raise` keeps the patch's frame (docs/limitations.md)
            assert not any(f.startswith(own) for f in files)
    assert torchs_set_grad_enabled() and guarded(model)


def test_an_evaluation_in_another_thread_leaves_this_threads_guard_to_this_threads_grad_mode() -> None:
    """The guard stands aside for the module, in every thread: a thread's forward with autograd on while another
    evaluates it runs as written (a documented limit), and the guard is back when the evaluation ends."""
    model = convnet().eval()
    x = torch.randn(1, 3, 8, 8)
    inside, done = threading.Event(), threading.Event()

    def evaluate() -> None:
        with torch.no_grad():
            model(x)
            inside.set()
            done.wait(10)

    thread = threading.Thread(target=evaluate)
    thread.start()
    assert inside.wait(10)
    try:
        assert model(x).requires_grad  # as written
    finally:
        done.set()
        thread.join()
    assert guarded(model) and torchs_set_grad_enabled()


def test_a_module_with_its_own_getstate_still_pickles_to_a_working_model() -> None:
    model = fakehub.OwnState().eval()
    assert guarded(model)
    again = pickle.loads(pickle.dumps(model))
    x = torch.ones(1, 2)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
    proc = run_python(f"import pickle, sys, torch\n"
                      f"m = pickle.loads({pickle.dumps(model)!r}); print(m(torch.ones(1, 2)).shape)\n"
                      f"print('safetorch' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["torch.Size([1, 2])", "False"]


def test_lightning_style_mode_restore_by_assignment_leaves_nothing_behind() -> None:
    model = convnet()
    model.eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 8, 8))
    for m in model.modules():  # Lightning's _ModuleMode.restore assigns the flags back
        m.training = True
    assert guarded(model)
    out = model(torch.randn(2, 3, 8, 8))
    assert out.requires_grad and not guarded(model)  # the guard saw a training module and left
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


class _Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, batch: Any) -> torch.Tensor:
        img = batch["inputs"]["img"] if isinstance(batch, dict) else batch.img
        return self.conv(img).relu()


@dataclasses.dataclass
class _Batch:
    img: torch.Tensor
    label: int = 0


@pytest.mark.parametrize("nesting", ["dict of dict", "dataclass"])
def test_a_frozen_eval_net_fed_a_generator_output_deep_in_its_input_keeps_the_gradient(nesting: str) -> None:
    def program() -> Any:
        torch.manual_seed(4)
        generator = nn.Conv2d(3, 3, 3, padding=1)
        features = _Features().eval()  # parameters still require grad; no optimizer holds them
        opt = torch.optim.SGD(generator.parameters(), lr=0.1)
        grads = []
        for _ in range(3):
            fake = generator(torch.randn(2, 3, 8, 8))
            batch = {"inputs": {"img": fake}} if nesting == "dict of dict" else _Batch(fake)
            loss = features(batch).mean() + fake.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            grads.append(generator.weight.grad.clone())
            opt.step()
        return grads, weights(generator)

    with findings() as got:
        on, off = both(program)
    assert got == []
    assert same(on, off)


def test_an_eval_mode_adapter_model_plus_a_value_term_keeps_adapter_gradients() -> None:
    """RL fine-tuning keeps the policy in eval mode (dropout off on purpose) and adds a value-net term."""

    class Adapted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(6, 6).requires_grad_(False)
            self.lora_a = nn.Linear(6, 2, bias=False)
            self.lora_b = nn.Linear(2, 6, bias=False)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.lora_b(self.lora_a(self.drop(x)))

    def program() -> Any:
        torch.manual_seed(5)
        policy, value = Adapted().eval(), nn.Linear(6, 1)
        adapter = [*policy.lora_a.parameters(), *policy.lora_b.parameters()]
        opt = torch.optim.SGD([*adapter, *value.parameters()], lr=0.05)
        grads = []
        for _ in range(4):
            x = torch.randn(5, 6)
            loss = policy(x).logsumexp(1).mean() + value(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in adapter])
            opt.step()
        return grads, weights(policy)

    on, off = both(program)
    assert same(on, off) and all(g is not None for step in on[0] for g in step)


class _ForceField(nn.Module):
    """Forces are minus the gradient of the energy: the forward calls torch.autograd.grad itself."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            pos = pos.detach().requires_grad_(True)
            e = self.energy(pos).sum()
            (g,) = torch.autograd.grad(e, pos)
        return -g


def test_a_force_field_whose_forward_calls_autograd_grad_runs_as_written() -> None:
    def program() -> Any:
        torch.manual_seed(6)
        model = _ForceField().eval()
        return [model(torch.randn(4, 3)) for _ in range(4)]

    with findings() as got:
        on, off = both(program)
    assert got == [] and same(on, off)


def test_grad_cam_registering_a_tensor_hook_in_a_forward_hook_runs_as_written() -> None:
    def program() -> Any:
        model = convnet().eval()
        saved: dict[str, torch.Tensor] = {}

        def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            saved["act"] = out
            out.register_hook(lambda g: saved.__setitem__("grad", g))

        model[3].register_forward_hook(keep)
        cams = []
        for _ in range(3):
            x = torch.randn(1, 3, 8, 8)
            score = model(x)
            score[0, 1].backward()
            cams.append((saved["grad"].mean((2, 3), keepdim=True) * saved["act"]).sum(1).relu().detach())
        return cams

    with findings() as got:
        on, off = both(program)
    assert got == [] and same(on, off)


def test_a_forward_that_registers_a_tensor_hook_without_a_backward_is_never_switched() -> None:
    class Hooking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            out.register_hook(lambda g: None)  # fails on a tensor that does not require grad
            return out

    model = Hooking().eval()
    with findings() as got:
        outs = [model(torch.randn(2, 3)) for _ in range(3)]
    assert got == [] and all(o.requires_grad for o in outs)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_a_no_grad_forward_leaves_grad_mode_on(interrupt: type[BaseException]) -> None:
    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 3:
                raise interrupt  # Ctrl-C during validation, in a notebook
            return self.lin(x)

    model = Slow().eval()
    kept = []
    with findings(), pytest.raises(interrupt):
        for _ in range(3):
            kept.append(keeps_activations(lambda: model(torch.ones(1, 2)))[1])
    assert kept == [True, False]  # the third ran as the act, and was interrupted
    assert torch.is_grad_enabled()
    other = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))  # an unrelated model in the next cell trains
    out, kept_by_other = keeps_activations(lambda: other(torch.ones(1, 2)))
    assert kept_by_other  # grad mode and saved-tensor hooks as they were
    out.sum().backward()
    assert other[0].weight.grad is not None


def test_an_exception_in_a_user_hook_inside_a_no_grad_forward_leaves_grad_mode_on() -> None:
    model = nn.Linear(2, 2).eval()
    calls = []

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        calls.append(torch.is_grad_enabled())
        if len(calls) == 2:
            raise ValueError("user hook")

    model.register_forward_hook(hook)
    with findings(), pytest.raises(ValueError):
        for _ in range(2):
            model(torch.ones(1, 2))
    assert calls == [True, False] and torch.is_grad_enabled()  # the second ran as under no_grad
    other = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    assert keeps_activations(lambda: other(torch.ones(1, 2)))[1]  # nothing of the act left standing


def test_an_unrelated_does_not_require_grad_error_keeps_torchs_type_and_message() -> None:
    model = convnet().eval()
    with findings():
        for _ in range(3):
            model(torch.randn(1, 3, 8, 8))

    def frozen_step() -> None:
        frozen = nn.Linear(3, 1).requires_grad_(False)
        frozen(torch.randn(2, 3)).sum().backward()

    with pytest.raises(RuntimeError) as info:
        frozen_step()
    assert type(info.value) is RuntimeError
    assert str(info.value).startswith("element 0 of tensors does not require grad")
    notes = getattr(info.value, "__notes__", [])
    assert all(n.startswith("ST003 note: if this loss comes from that forward") for n in notes)
    safetorch.uninstall()
    with pytest.raises(RuntimeError) as plain:
        frozen_step()
    assert str(plain.value) == str(info.value)
    safetorch.install()
    with pytest.raises(RuntimeError) as later:  # a backward since: no note at all
        nn.Linear(3, 1)(torch.randn(2, 3)).sum().backward()
        frozen_step()
    assert type(later.value) is RuntimeError and not getattr(later.value, "__notes__", [])


def test_a_site_taken_for_an_evaluation_then_trained_through_gets_its_gradients() -> None:
    """A helper shared by validation and training, with the model still in eval mode (a sanity validation pass
    first, as Lightning's num_sanity_val_steps runs): the backward recomputes the act's forward, and from then
    on the site runs as written."""

    def program() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def forward(x: torch.Tensor) -> torch.Tensor:
            return model(x)  # the one call site

        for _ in range(3):  # a validation pass first
            forward(torch.randn(2, 3)).argmax(1)
        grads = []
        for _ in range(3):  # then training
            loss = forward(torch.randn(2, 3)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            grads.append(model[0].weight.grad.clone())
            opt.step()
        return grads, weights(model)

    with findings() as got:
        on, off = both(program)
        program()
    # The validation pass is reported, and training the model in eval mode after an evaluation is ST008's finding
    # (the forgotten model.train() after validation): findings, while the numbers stay the program's.
    assert [w.category for w in got] == [EvalModeGradWarning, EvalModeTrainingWarning]
    assert same(on, off) and all(g.abs().sum() > 0 for g in on[0])
    # The helper is called by the function that put the model in eval mode: each of its calls there is a site of
    # its own (the validation pass's and the training loop's), and the training one runs as written.
    states = sorted(site.state for site in eval_mode_grad._sites.sites.values())
    assert states == ["eval", "train"]


def test_several_forwards_at_one_line_before_one_backward_get_every_gradient() -> None:
    """Two views through an eval-mode encoder in one comprehension, one loss: the first view's graph is alive at the
    second forward (nothing decided); the backward recomputes the second and trains on the whole gradient."""

    def program() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).eval()
        views = [model(torch.randn(2, 3)) for _ in range(2)]
        (views[0] * views[1]).sum().backward()
        return [p.grad for p in model.parameters()]

    with findings() as got:
        on, off = both(program)
        program()
    assert got == [] and same(on, off)


def test_jit_trace_of_an_eval_model_reports_nothing_even_in_strict_mode() -> None:
    safetorch.install(strict=True)
    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8)
    with findings() as got, warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = [torch.jit.trace(model, x) for _ in range(3)]
    assert [w for w in got if issubclass(w.category, safetorch.SafetorchWarning)] == []
    with torch.no_grad():
        assert torch.allclose(traced[-1](x), model(x))


with warnings.catch_warnings():  # torch 2.10+ deprecates torch.jit.script; programs still use it
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def _scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.mark.python
def test_a_scripted_class_resolves_module_level_names() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        @torch.jit.script
        class Scaler:
            def __init__(self, k: float) -> None:
                self.k = k

            def apply(self, x: torch.Tensor) -> torch.Tensor:
                return _scale(x) * self.k

    assert torch.equal(Scaler(1.5).apply(torch.ones(2)), torch.full((2,), 3.0))


@pytest.mark.parametrize("form", ["enable_grad", "set_grad_enabled", "inference_mode"])
def test_decorators_that_switch_grad_on_are_an_explicit_opt_out_for_their_scope_only(form: str) -> None:
    model = convnet().eval()
    decorator = {"enable_grad": torch.enable_grad(), "set_grad_enabled": torch.set_grad_enabled(True),
                 "inference_mode": torch.inference_mode(False)}[form]

    @decorator
    def train_through(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with findings() as got:
        outs = [train_through(torch.randn(1, 3, 8, 8)) for _ in range(3)]
    assert got == [] and all(o.requires_grad for o in outs)
    with findings() as got:  # outside the scope: checked again
        after = [keeps_activations(lambda: model(torch.randn(1, 3, 8, 8)))[1] for _ in range(2)]
    assert after == [True, False] and len(got) == 1


def test_with_blocks_that_switch_grad_on_opt_out_and_torchs_own_restores_do_not() -> None:
    model = convnet().eval()
    x = torch.randn(1, 3, 8, 8)
    with findings() as got:
        for _ in range(3):
            with torch.enable_grad():
                assert model(x).requires_grad
            with torch.set_grad_enabled(True):
                assert model(x).requires_grad
    assert got == []
    with torch.no_grad():
        pass
    with torch.set_grad_enabled(False):
        pass
    with findings() as got:
        kept = [keeps_activations(lambda: model(x))[1] for _ in range(2)]
    assert kept == [True, False] and len(got) == 1


def test_frozen_batchnorm_fine_tuning_costs_nothing_per_module() -> None:
    """Every BatchNorm put in eval mode by the program: the children lose their guards at the first forward, and
    grad-mode switches and optimizer steps are torch's own functions, touching no module."""
    net = convnet()
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in bns:
        m.eval()
    assert all(guarded(m) for m in bns)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with findings() as got:
        loss = net(torch.randn(2, 3, 8, 8)).sum()
        loss.backward()
        opt.step()
    assert got == [] and not any(guarded(m) for m in bns)
    from torch.autograd import grad_mode

    assert not safetorch._patch.is_patch(grad_mode.set_grad_enabled.__dict__["__init__"])
    assert not safetorch._patch.is_patch(grad_mode.no_grad.__dict__["__enter__"])
    assert not safetorch._patch.is_patch(torch.optim.SGD.step)


def test_frozen_batchnorm_in_a_training_parent_gets_gradients() -> None:
    def program() -> Any:
        torch.manual_seed(7)
        net = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
        net.train()
        net[0].eval()  # frozen statistics; its affine weights still train
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):
            loss = net(torch.randn(4, 3, 8, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return weights(net)

    with findings() as got:
        on, off = both(program)
    assert got == [] and same(on, off)


def test_many_eval_calls_do_not_grow_anything() -> None:
    model = convnet()
    for _ in range(2000):
        model.eval()
        model.train()
    assert not guarded(model) and eval_mode_grad._sites.guarded == {}
    for m in model.modules():
        for table in (m._forward_pre_hooks, m._forward_hooks, m._forward_hooks_with_kwargs,
                      m._forward_pre_hooks_with_kwargs, m._forward_hooks_always_called):
            assert len(table) == 0
    model.eval()
    assert guarded(model) and not any(guarded(m) for m in list(model.modules())[1:])


@pytest.mark.parametrize("grad", [True, False])
def test_a_deep_copy_of_an_eval_model_is_checked_like_the_original(grad: bool) -> None:
    model = convnet().eval()
    with torch.set_grad_enabled(grad):
        ema = copy.deepcopy(model)
    assert guarded(ema) and ema.__dict__["_call_impl"].module() is ema
    with findings() as got:
        kept = [keeps_activations(lambda: ema(torch.randn(1, 3, 8, 8)))[1] for _ in range(2)]; line = lineno()  # noqa
    assert kept == [True, False]
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]
    assert "ema (Sequential)" in str(got[0].message)


# --- look-alikes that must stay silent and keep their gradients ------------------------------------------------


def test_perceptual_loss_through_a_frozen_eval_net_keeps_generator_gradients() -> None:
    def program() -> Any:
        torch.manual_seed(8)
        generator = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1))
        features = convnet()[:5].eval()
        for p in features.parameters():
            p.requires_grad_(False)
        grads = []
        for _ in range(3):
            fake = generator(torch.randn(2, 3, 8, 8))
            loss = nn.functional.mse_loss(features(fake), features(torch.randn(2, 3, 8, 8)))
            generator.zero_grad()
            loss.backward()
            grads.append(generator[0].weight.grad.clone())
        return grads

    with findings() as got:
        on, off = both(program)
    assert got == [] and same(on, off) and on[0].abs().sum() > 0


def test_adversarial_inputs_through_an_eval_site_keep_their_gradient() -> None:
    model = convnet().eval()

    def score(x: torch.Tensor) -> torch.Tensor:
        return model(x)  # one call site for evaluation and attack

    with findings() as got:
        for _ in range(2):
            score(torch.randn(1, 3, 8, 8))  # the site is decided an evaluation
        x = torch.randn(1, 3, 8, 8, requires_grad=True)
        for _ in range(3):  # now attacking: an input that requires grad runs as written
            score(x)[:, 1].sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert [w.category for w in got] == [EvalModeGradWarning]


def test_input_requiring_grad_deep_in_a_later_call_runs_as_written() -> None:
    model = _Features().eval()

    def call(img: torch.Tensor) -> torch.Tensor:
        return model({"inputs": {"img": img}})

    with findings():
        for _ in range(2):
            call(torch.randn(1, 3, 4, 4))
        img = torch.randn(1, 3, 4, 4, requires_grad=True)
        call(img).sum().backward()
    assert img.grad is not None


def test_model_to_device_as_a_statement_and_training_models_are_untouched() -> None:
    model = convnet()
    with findings() as got:
        model.to("cpu")
        out = model(torch.randn(2, 3, 8, 8))
    assert got == [] and out.requires_grad and not guarded(model)


def test_nested_eval_modules_report_once_at_the_top_level_call() -> None:
    outer = nn.Sequential(convnet(), nn.Linear(4, 2)).eval()
    with findings() as got:
        for _ in range(3):
            outer(torch.randn(1, 3, 8, 8)); line = lineno()  # noqa: E702
    assert [w.lineno for w in got] == [line]


def test_threads_keep_their_own_explicit_grad_mode() -> None:
    evaluated = convnet().eval()
    errors: list[str] = []

    def evaluate() -> None:
        kept = [keeps_activations(lambda: evaluated(torch.randn(1, 3, 8, 8)))[1] for _ in range(50)]
        if any(kept[1:]):  # saved-tensor hooks are per thread, as grad mode is
            errors.append("an evaluation kept its activations")

    def train() -> None:
        for _ in range(50):
            with torch.enable_grad():
                if not evaluated(torch.randn(1, 3, 8, 8)).requires_grad:
                    errors.append("explicit enable_grad lost in a thread")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=f) for f in (evaluate, train, evaluate, train)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == [] and torch.is_grad_enabled()


def test_transforms_of_an_eval_model_keep_working_and_report_nothing() -> None:
    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = model(x)
    with findings() as got, warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        assert torch.allclose(torch.jit.script(model)(x), expected)
        assert torch.allclose(torch.jit.trace(model, x)(x), expected)
        assert torch.allclose(torch.fx.symbolic_trace(model)(x), expected)
        assert torch.allclose(torch.export.export(model, (x,)).module()(x), expected)
    assert [w for w in got if issubclass(w.category, safetorch.SafetorchWarning)] == []
    with findings():
        assert torch.allclose(nn.DataParallel(model)(x), expected)


def test_dataparallel_replicas_carry_no_guard() -> None:
    model = convnet().eval()
    replica = model._replicate_for_data_parallel()
    assert guarded(model) and not guarded(replica)


def test_torch_compile_sees_no_new_graph_break() -> None:
    import torch._dynamo

    model = convnet().eval()
    x = torch.randn(2, 3, 8, 8)
    torch._dynamo.reset()
    ours = torch._dynamo.explain(model)(x)
    safetorch.uninstall()
    torch._dynamo.reset()
    theirs = torch._dynamo.explain(model)(x)
    safetorch.install()
    model.eval()
    assert ours.graph_break_count == theirs.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with findings() as got:
        outs = [compiled(x) for _ in range(3)]
    assert got == [] and all(torch.allclose(o, outs[0]) for o in outs)


@pytest.mark.python
def test_an_evaluation_mixing_eager_and_compiled_calls_of_one_model_compiles_it_once() -> None:
    """The guard standing aside and coming back (an eager forward under no_grad, then the scope's end) changes the
    module's ``__dict__`` between compiled calls: the compiled model is compiled once, with safetorch as without."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def run() -> tuple[int, list[torch.Tensor]]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
        compiled = torch.compile(model, backend="aot_eager")
        x, outs = torch.randn(3, 4), []
        for _ in range(3):
            with torch.no_grad():
                outs.append(model(x))
                outs.extend(compiled(x) for _ in range(3))
        return counters["stats"]["unique_graphs"], outs

    on, off = both(run)
    assert on[0] == off[0] == 1 and same(on[1], off[1])


def test_uninstall_takes_every_guard_off_and_forgets_every_site() -> None:
    model = convnet().eval()
    with findings():
        for _ in range(2):
            model(torch.randn(1, 3, 8, 8))
    assert eval_mode_grad._sites.sites
    safetorch.uninstall()
    assert not guarded(model) and not eval_mode_grad._sites.sites and not eval_mode_grad._sites.guarded
    assert model(torch.randn(1, 3, 8, 8)).requires_grad
    safetorch.install()


def test_ignoring_st003_keeps_st008() -> None:
    safetorch.install(ignore=["ST003"])
    with findings() as got:
        model = fakehub.from_pretrained()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outs = []
        for _ in range(3):
            outs.append(model(torch.randn(2, 6))); line = lineno()  # noqa: E702
            opt.zero_grad()
            outs[-1].sum().backward()
            opt.step()
    # the outputs kept across steps are ST004's (their graphs' nodes stay alive); ST003 is off, ST008 stays
    assert [(w.category, w.lineno) for w in got if w.category is not GraphAccumulationWarning] == \
        [(EvalModeTrainingWarning, line)]
    safetorch.install(ignore=["ST003", "ST008"])
    assert not guarded(fakehub.from_pretrained())


def test_a_model_never_freed_by_its_guard() -> None:
    import gc
    import weakref

    model = convnet().eval()
    with findings():
        model(torch.randn(1, 3, 8, 8))
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None  # freed by reference counting, at once: no cycle through the guard
    finally:
        gc.enable()


def test_python_c_and_exec_code_get_the_finding(tmp_path: Any) -> None:
    proc = run_python(
        "import torch, safetorch\n"
        "m = torch.nn.Linear(2, 2).eval()\n"
        "src = 'for _ in range(3):\\n    out = m(torch.ones(1, 2))\\n'\n"
        "exec(compile(src, 'f.py', 'exec'), {'m': m, 'torch': torch, '__name__': 'f'})\n"
        "print(torch.is_grad_enabled())\n")
    assert proc.returncode == 0, proc.stderr
    assert "f.py:2: EvalModeGradWarning: ST003 model (Linear)" in proc.stderr  # no source to name `m` from
    assert proc.stdout.strip() == "True"


def test_a_training_loop_pays_no_st003_listener_on_its_backwards() -> None:
    """ST003 listens to backwards only from a watched forward to the next backward."""
    from safetorch import _backward

    def listening() -> bool:
        return eval_mode_grad._before_backward in _backward._before_now

    model, evaluated = nn.Linear(2, 1), nn.Linear(2, 1).eval()
    model(torch.ones(1, 2)).sum().backward()
    assert not listening()
    with findings():
        for _ in range(2):
            evaluated(torch.ones(1, 2))  # watched, then the act
    assert listening()
    seen = []
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        seen.append(listening())
    assert seen == [False, False, False]


def test_a_childs_train_call_in_one_thread_leaves_another_threads_eval_top_level() -> None:
    # A train() call made while another one runs *in the same thread* is a child's (no guard); one made meanwhile in
    # another thread is that thread's own top-level call and gets its guard.
    other = nn.Sequential(nn.Linear(2, 2))
    done = threading.Event()

    class Child(nn.Linear):
        def train(self, mode: bool = True) -> Child:
            if not mode and not done.is_set():
                worker = threading.Thread(target=other.eval)
                worker.start()
                worker.join()
                done.set()
            return super().train(mode)

    model = nn.Sequential(Child(2, 2), nn.ReLU())
    model.eval()
    assert done.is_set()
    assert guarded(model) and not guarded(model[0]) and not guarded(model[1])
    assert guarded(other) and not guarded(other[0])
    model.train()
    other.train()
    assert not guarded(model) and not guarded(other)


def test_a_parents_train_takes_off_a_childs_own_guard_and_a_frozen_batchnorm_override_stays_silent() -> None:
    # train() does no per-thread bookkeeping: each module it reaches takes off its own guard. A subclass whose train()
    # freezes its BatchNorm (eval() inside the parent's train()) fine-tunes silently, with every gradient.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.conv(x))

        def train(self, mode: bool = True) -> Net:
            super().train(mode)
            self.bn.eval()
            return self

    plain = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    plain[1].eval()
    assert guarded(plain[1])
    plain.train()
    assert not guarded(plain[1]) and not guarded(plain)

    net = Net()
    with findings() as got:
        for _ in range(3):
            net.train()
            net(torch.randn(2, 3, 6, 6)).sum().backward()
    assert got == []
    assert all(p.grad is not None for p in net.parameters())
    assert not net.bn.training and net.training


class _SkorchNet:
    """The shape of skorch's NeuralNet before #219: train_step and validation_step share `infer`, which calls the
    module; validation_step puts the module in eval mode and the fix wraps its call in `torch.no_grad()`."""

    validation_line = 0

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.module_ = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.optimizer_ = torch.optim.SGD(self.module_.parameters(), lr=0.1)

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        return self.module_(x)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.module_.train()
        self.optimizer_.zero_grad()
        nn.functional.cross_entropy(self.infer(x), y).backward()
        self.optimizer_.step()

    def validation_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.module_.eval()
        y_pred = self.infer(x); _SkorchNet.validation_line = lineno()  # noqa: E702
        return float(nn.functional.cross_entropy(y_pred, y))

    def fit(self, epochs: int = 2) -> list[float]:
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        losses = []
        for _ in range(epochs):
            for xb, yb in zip(x.split(4), y.split(4), strict=True):
                self.train_step(xb, yb)
            losses += [self.validation_step(xb, yb) for xb, yb in zip(x.split(2), y.split(2), strict=True)]
        return losses


def test_skorch_219_a_forward_in_a_shared_helper_is_reported_at_the_evaluations_call() -> None:
    """The helper's line also trains; the line to fix is validation_step's, which called eval() and then the
    helper (skorch#219 put `with torch.no_grad():` there)."""
    with findings() as got:
        _SkorchNet().fit()
    found = [(w.category, w.filename, w.lineno) for w in got if w.category is EvalModeGradWarning]
    assert found == [(EvalModeGradWarning, __file__, _SkorchNet.validation_line)]


# --- what the act keeps, and when the finding is made ------------------------------------------------------------


def test_a_two_batch_evaluation_is_reported_at_its_forward_when_training_resumes() -> None:
    """Two batches: the first forward is watched, its graph dies when the second one's output replaces it; the
    evidence is in, and ``model.train()`` (the evaluation's end) reports it at the forward's line."""
    model = convnet().eval()
    with findings() as got:
        for _ in range(2):
            outputs = model(torch.randn(2, 3, 8, 8)); line = lineno()  # noqa: E702
            outputs.argmax(1)
        assert got == []  # nothing came yet that could decide it: the next forward at any line, train(), or exit
        model.train()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EvalModeGradWarning, __file__, line)]
    assert "saw its graph die unused" in str(got[0].message)


def test_strict_mode_leaves_a_decision_made_elsewhere_to_the_forwards_own_line() -> None:
    safetorch.install(strict=True)
    model = convnet().eval()
    for _ in range(2):
        outputs = model(torch.randn(2, 3, 8, 8))
    model.train()  # not the line that made the graphs: nothing raised here
    model.eval()
    with pytest.raises(SafetorchError) as info:
        for _ in range(3):  # the third forward finds the first one's graph dead: decided while this line runs
            outputs = model(torch.randn(2, 3, 8, 8)); line = lineno()  # noqa: E702
    assert info.value.code == "ST003" and (info.value.filename, info.value.lineno) == (__file__, line)
    del outputs


def test_a_collecting_evaluation_keeps_no_activation_and_lets_go_of_its_inputs() -> None:
    """``outs.append(model(x))``: the watched first forward keeps its graph (the program holds it); every later one
    keeps what no_grad keeps, and, while nothing is decided, holds its inputs only while the forwards before the
    newest hold at most `HELD_BYTES` of them (small batches here: all nine; the next test has large ones)."""
    model = convnet().eval()
    inputs, kept, outs = [], [], []
    with findings():
        for _ in range(10):
            x = torch.randn(2, 3, 8, 8)
            inputs.append(weakref.ref(x))
            out, k = keeps_activations(lambda x=x: model(x))
            kept.append(k)
            outs.append(out)
            del x
    assert kept == [True] + [False] * 9
    assert all(o.grad_fn is not None for o in outs)
    alive = sum(r() is not None for r in inputs)
    assert alive == 9  # the nine after the watched one (whose graph holds only its input's storage): 13.8 kB in all
    assert 8 * inputs[-1]().nbytes <= eval_mode_grad._eval_act.HELD_BYTES


def test_a_collecting_evaluation_of_large_batches_holds_only_the_newest_forwards_inputs() -> None:
    """A validation loader's batches are not a policy's observations: of the forwards before the newest, none holds
    an input past `HELD_BYTES`, so what the act keeps is no_grad's plus the watched graph and one batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    batch_bytes = 640 * 512 * 4
    assert batch_bytes > eval_mode_grad._eval_act.HELD_BYTES
    inputs, outs = [], []
    with findings():
        for _ in range(6):
            x = torch.randn(640, 512)
            inputs.append(weakref.ref(x))
            outs.append(model(x))
            del x
    alive = [r() is not None for r in inputs]
    assert alive == [True, False, False, False, False, True]  # the watched graph's input, and the newest batch


@dataclasses.dataclass
class _Output(dict):  # type: ignore[type-arg]
    """Shaped as transformers' ModelOutput: a dict and a dataclass, fields also reachable as keys."""

    logits: torch.Tensor | None = None
    hidden: tuple[torch.Tensor, ...] | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.a(x).tanh()
        logits = self.b(h)
        return {"out": _Output(logits=logits.view(-1), hidden=(h, h[:, :2])), "ids": logits.argmax(1), "x": x}


def test_nested_outputs_keep_their_structure_and_views_and_a_backward_after_one_gets_every_gradient() -> None:
    def program() -> Any:
        model = _Nested().eval()
        torch.manual_seed(1)
        results = []
        for i in range(4):
            x = torch.randn(2, 3)
            out = model(x)
            results.append((type(out["out"]).__name__, out["out"].logits, out["out"]["hidden"][1], out["ids"],
                            out["x"] is x, out["ids"].requires_grad))
            if i == 3:  # a diagnostic: one backward right after a forward the act ran
                (out["out"].logits.sum() + out["out"].hidden[1].pow(2).sum()).backward()
        return results, [p.grad for p in model.parameters()]

    with findings() as got:
        on, off = both(program)
    assert same(on, off) and all(g is not None and g.abs().sum() > 0 for g in on[1])
    assert on[0][-1][0] == "_Output" and on[0][-1][4] is True and on[0][-1][5] is False
    assert got == []  # the watched graph is kept (results), and the backward tells that this line trains


def test_an_output_backwarded_two_batches_later_gets_the_same_gradients() -> None:
    """Outputs kept in a queue and trained on two batches later (the watched graph is alive when the next forwards
    run, so nothing is decided and they hold their inputs): silent, with the program's numbers."""

    def program() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).eval()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        queue, grads = [], []
        for _ in range(6):
            queue.append(model(torch.randn(5, 3)))
            if len(queue) == 3:  # no step in between: an optimizer step would fail this backward without safetorch
                opt.zero_grad()
                queue.pop(0).pow(2).mean().backward()
                grads.append(model[0].weight.grad.clone())
        opt.step()
        return grads, weights(model)

    with findings() as got:
        on, off = both(program)
    assert same(on, off) and len(on[0]) == 4
    assert [w.category for w in got if w.category is EvalModeGradWarning] == []


def _evaluated(model: nn.Module) -> nn.Module:
    return model.eval()


def test_a_backward_that_cannot_recompute_a_decided_forward_is_explained_at_the_backward_line() -> None:
    # eval() called elsewhere: `predict`'s line is the site (a helper called by the function that called eval() would
    # hand the site to its callers' lines, skorch#219's shape)
    model = _evaluated(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))

    def predict(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    forward = predict.__code__.co_firstlineno + 1
    with findings():
        for _ in range(3):
            predict(torch.randn(2, 3))  # an evaluation: decided at the third forward
        outs = [predict(torch.randn(2, 3)) for _ in range(3)]  # decided: only the newest holds its input
        with pytest.raises(SafetorchError) as info:
            line = lineno() + 1
            outs[0].sum().backward()
    message = str(info.value)
    assert message.startswith(f"ST003 this backward reaches the output of model(Sequential) at {__file__}:{forward}")
    assert "its input tensors are no longer alive" in message and "Write: model.train()" in message
    assert "`with torch.no_grad():`" in message
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(info.value.__traceback__)]
    assert (__file__, line) in frames


def test_a_filter_set_to_error_raises_a_finding_decided_at_train_and_the_model_still_trains() -> None:
    model = convnet().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvalModeGradWarning)
        for _ in range(2):
            outputs = model(torch.randn(2, 3, 8, 8)); line = lineno()  # noqa: E702
        with pytest.raises(EvalModeGradWarning) as info:
            model.train()
    assert model.training and not guarded(model)
    assert str(info.value).startswith("ST003 model (Sequential) is in eval mode with autograd on")
    assert [(s.filename, s.lineno) for s in safetorch._report.findings() if s.code == "ST003"] == [(__file__, line)]
    del outputs
