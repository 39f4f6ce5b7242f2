"""Correct programs that ST003/ST008's mechanism once broke (a crash, lost gradients, wrong numbers), each run with
safetorch on and off: the same numbers and gradients. Findings are allowed where the program has the mistake; a crash
or a changed number is not."""

from __future__ import annotations

import copy
import io
import multiprocessing.reduction
import pickle
from collections.abc import Callable
from typing import Any

import fakehub  # tests/site-packages: a library, put on the path by conftest
import pytest
import torch
import torch.nn as nn
import torch.optim.optimizer as optimizer_module
from torch.optim.optimizer import register_optimizer_step_pre_hook

import safetorch
from safetorch import EvalModeGradWarning, EvalModeTrainingWarning
from safetorch.checks import eval_mode_grad

from .conftest import findings, lineno
from .test_eval_mode_grad import both, guarded, keeps_activations, same, weights

# --- no global state mutated from inside torch's iteration ----------------------------------------------------


def _two_models_then_a_loaded_one(register_user_hook: Callable[[], Any] | None, when: str) -> Any:
    """A first model trains past its first step window; then a loaded (eval-mode) model gets its first backward and
    its optimizer is built after it, so that the step checks' hook stands after ST008's; a user's logging hook is
    registered before or after ours."""
    torch.manual_seed(0)
    calls: list[str] = []
    handles = []
    if when == "first" and register_user_hook:
        handles.append(register_user_hook(calls))
    first = nn.Linear(6, 3)
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    for _ in range(12):
        opt.zero_grad()
        first(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    second = fakehub.from_pretrained()
    second(torch.randn(4, 6)).pow(2).mean().backward()  # ST008's step hook goes in place
    if when == "middle" and register_user_hook:
        handles.append(register_user_hook(calls))
    opt2 = torch.optim.SGD(second.parameters(), lr=0.1)  # the step checks' hook goes in place after it
    if when == "last" and register_user_hook:
        handles.append(register_user_hook(calls))
    for _ in range(4):
        opt2.step()  # ST008's hook is done at the first: it must not leave torch's hook dict while torch iterates it
        opt2.zero_grad()
        second(torch.randn(4, 6)).pow(2).mean().backward()
    for h in handles:
        h.remove()
    return weights(second), len(calls)


def _logging_hook(calls: list[str]) -> Any:
    return register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append("step"))


@pytest.mark.parametrize("when", ["first", "middle", "last", "none"])
def test_another_global_step_hook_after_st008s_does_not_crash_the_step(when: str) -> None:
    hook = None if when == "none" else _logging_hook
    on, off = both(lambda: _two_models_then_a_loaded_one(hook, when))
    with findings() as got:
        _two_models_then_a_loaded_one(hook, when)
    assert same(on[0], off[0])
    assert on[1] == off[1] == {"first": 16, "middle": 4, "last": 4, "none": 0}[when]  # at every step after it
    assert EvalModeTrainingWarning in {w.category for w in got}  # the loaded model is trained in eval mode
    assert not any(eval_mode_grad._step_pre_hook is h for h in
                   optimizer_module._global_optimizer_pre_hooks.values())  # gone at a later backward


def test_user_hooks_before_and_after_every_one_of_ours_are_all_called() -> None:
    """A step pre-hook, forward pre/post hooks and a tensor backward hook of the user's, registered before and after
    each of ours (ST003/ST008's guard and step hook, the step checks' hook, ST006's and ST011's backward hooks), over
    a program that makes those rules fire."""
    seen: list[str] = []

    def program() -> Any:
        torch.manual_seed(0)
        seen.clear()
        user = [register_optimizer_step_pre_hook(lambda o, a, k: seen.append("step-before"))]
        model = fakehub.from_pretrained()
        model.register_forward_pre_hook(lambda m, a: seen.append("pre"))
        model.register_forward_hook(lambda m, a, o: seen.append("post"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        user.append(register_optimizer_step_pre_hook(lambda o, a, k: seen.append("step-after")))
        for i in range(12):
            out = model(torch.randn(4, 6))
            out.register_hook(lambda g: seen.append("grad"))
            out.pow(2).mean().backward()  # no zero_grad: ST011
            if i == 5:  # ST006, on a tensor of its own
                (torch.ones(1, requires_grad=True) * float("nan")).sum().backward()
            opt.step()
            user.insert(0, register_optimizer_step_pre_hook(lambda o, a, k: seen.append("step-late")))
        for h in user:
            h.remove()
        return weights(model), list(seen)

    on, off = both(program)
    with findings() as got:
        program()
    assert same(on, off)
    assert on[1].count("step-before") == on[1].count("step-after") == on[1].count("grad") == 12
    assert on[1].count("step-late") == 11 * 12 // 2 and on[1].count("pre") == on[1].count("post") == 12
    assert {"ST006", "ST008", "ST011"} <= {str(w.message)[:5] for w in got}


# --- a site is only ever decided by real top-level calls ------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def _frozen_statistics_training(before: Callable[[_Net], Any]) -> Any:
    torch.manual_seed(0)
    net = _Net()
    net.enc.eval()  # frozen BatchNorm statistics; the encoder's weights still train
    before(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        loss = net(torch.randn(5, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return weights(net), net.enc[0].weight.grad


@pytest.mark.parametrize("before", ["fx", "forward"])
def test_a_submodule_reached_without_its_parents_call_is_still_trained(before: str) -> None:
    """Two fx traces (a graph dump, a shape pass) or two direct net.forward(x) calls before training through net(x)."""

    def run_first(net: _Net) -> None:
        for _ in range(2):
            if before == "fx":
                torch.fx.symbolic_trace(net)
            else:
                net.forward(torch.randn(5, 4))

    with findings() as got:
        on, off = both(lambda: _frozen_statistics_training(run_first))
    assert same(on, off) and on[1] is not None and on[1].abs().sum() > 0
    assert got == []


def test_a_flop_count_of_an_eval_model_neither_watches_nor_decides() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).eval()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with findings() as got:
        for _ in range(3):
            with FlopCounterMode(display=False):
                forward(torch.randn(2, 4))
    assert got == [] and not eval_mode_grad._sites.sites


# --- the guard belongs to one module and never leaves it --------------------------------------------------------


def _graph_module() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    gm.eval()
    gm(torch.randn(1, 3))  # safetorch: ignore[ST003]  (a second graph module here is a second forward at this line)
    return gm


def _clean(data: bytes) -> bool:
    """Pickled bytes that hold nothing of safetorch's (pickle's memo makes bytes differ between two instances of one
    model even without safetorch, as string objects are shared or not: compare what is in them)."""
    return not any(part in data for part in (b"_call_impl", b"safetorch", b"functools", b"partial"))


def test_an_eval_mode_graph_module_pickles_saves_and_packages_as_without_safetorch(tmp_path: Any) -> None:
    def dumps() -> tuple[bytes, bytes, bytes]:
        gm = _graph_module()
        saved = io.BytesIO()
        torch.save(gm, saved)
        return pickle.dumps(gm), saved.getvalue(), bytes(multiprocessing.reduction.ForkingPickler.dumps(gm))

    with findings():
        on, off = both(dumps)  # RecursionError before: GraphModule.__reduce__ copies the __dict__ itself
    assert all(_clean(b) for b in on) and [len(b) for b in on] == [len(b) for b in off]
    loaded = pickle.loads(on[0])
    assert not guarded(loaded) and torch.equal(loaded(torch.ones(1, 3)), _graph_module()(torch.ones(1, 3)))
    from torch import package

    path = str(tmp_path / "gm.pt")
    with findings(), package.PackageExporter(path) as exporter:
        exporter.intern("**")
        exporter.save_pickle("model", "model.pkl", _graph_module())
    back = package.PackageImporter(path).load_pickle("model", "model.pkl")
    assert torch.equal(back(torch.ones(1, 3)), _graph_module()(torch.ones(1, 3)))


def test_a_clone_made_by_copying_the_dict_runs_its_own_forward() -> None:
    """``clone = cls.__new__(cls); clone.__dict__.update(m.__dict__)`` with the clone's weights then replaced, and
    accelerate's regional compilation (``new.__dict__.update(module.__dict__)`` then compiled children)."""
    model = nn.Linear(3, 3).eval()
    model(torch.ones(1, 3))  # safetorch: ignore[ST003]  (the forward that puts the guard in place)
    clone = nn.Linear.__new__(nn.Linear)
    clone.__dict__.update(model.__dict__)
    clone._parameters = {"weight": nn.Parameter(torch.zeros(3, 3)), "bias": nn.Parameter(torch.zeros(3))}
    with findings():
        for _ in range(3):
            assert torch.equal(clone(torch.ones(1, 3)), torch.zeros(1, 3))
    assert not guarded(clone) and guarded(model)

    outer = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).eval()
    outer(torch.ones(1, 3))
    regional = nn.Sequential.__new__(nn.Sequential)
    regional.__dict__.update(outer.__dict__)
    regional._modules = {k: torch.compile(v, backend="eager") for k, v in outer._modules.items()}
    with findings():
        got = [regional(torch.ones(1, 3)) for _ in range(3)]
        assert all(torch.equal(g, outer(torch.ones(1, 3))) for g in got)


def test_copy_copy_and_torch_save_of_an_eval_mode_lstm() -> None:
    def saved() -> tuple[bytes, Any]:
        torch.manual_seed(0)
        lstm = nn.LSTM(3, 4).eval()
        lstm(torch.randn(2, 1, 3))
        shallow = copy.copy(lstm)
        buf = io.BytesIO()
        torch.save(lstm, buf)
        return buf.getvalue(), shallow

    with findings():
        on, off = both(saved)
    assert _clean(on[0])
    loaded = torch.load(io.BytesIO(on[0]), weights_only=False)
    assert not guarded(loaded) and loaded.__dict__.keys() == off[1].__dict__.keys()
    shallow = on[1]
    assert not guarded(shallow)
    shallow.weight_hh_l0 = nn.Parameter(torch.zeros_like(shallow.weight_hh_l0))  # the copy's own weights
    shallow.flatten_parameters()
    plain = copy.copy(shallow)
    x = torch.randn(2, 1, 3)
    assert torch.equal(shallow(x)[0], plain(x)[0])


def test_compile_of_an_eval_mode_module_compiles_the_module_not_the_guard() -> None:
    import torch._dynamo

    def graphs() -> int:
        torch._dynamo.reset()
        counts = torch._dynamo.utils.counters
        counts.clear()
        m = nn.Sequential(nn.Linear(3, 3), nn.ReLU()).eval()
        m.compile(backend="eager")
        for _ in range(3):
            m(torch.ones(1, 3))
        return int(counts["stats"]["unique_graphs"])

    with findings() as got:
        on, off = both(graphs)
    assert on == off and got == []


# --- evidence that survives, and an act that cannot lose a gradient -------------------------------------------


def test_a_model_kept_in_eval_mode_while_it_trains_after_a_sanity_validation() -> None:
    """Lightning's num_sanity_val_steps: two validation steps through the same step() helper, then training with
    BatchNorm frozen on purpose."""

    def program() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).eval()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

        def step(x: torch.Tensor) -> torch.Tensor:
            return model(x).pow(2).mean()

        for _ in range(2):
            step(torch.randn(6, 4)).item()  # the sanity check
        losses = []
        for _ in range(5):
            loss = step(torch.randn(6, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return weights(model), losses

    with findings():
        on, off = both(program)
    assert same(on, off)


def test_an_eval_mode_policy_whose_rollout_and_update_share_a_helper() -> None:
    """RL: evaluate(obs) serves the rollout (written without no_grad) and then the PPO-style update."""

    def program() -> Any:
        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).eval()
        opt = torch.optim.SGD(policy.parameters(), lr=0.05)

        def evaluate(obs: torch.Tensor) -> torch.Tensor:
            return policy(obs).log_softmax(-1)

        history = []
        for _ in range(3):
            obs = [torch.randn(1, 4) for _ in range(6)]
            actions = [int(evaluate(o).argmax()) for o in obs]  # the rollout: graphs die unused
            logp = torch.cat([evaluate(o)[0, a:a + 1] for o, a in zip(obs, actions, strict=True)])
            loss = -logp.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            history.append(loss.item())
        return weights(policy), history

    with findings():
        on, off = both(program)
    assert same(on, off)


def test_a_gradient_norm_diagnostic_every_fourth_evaluation_batch() -> None:
    def program() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
        norms = []
        for i in range(12):
            out = model(torch.randn(5, 4))
            if i % 4 == 3:
                model.zero_grad()
                out.logsumexp(-1).sum().backward()
                norms.append(model[0].weight.grad.norm().item())
        return norms

    with findings():
        on, off = both(program)
    assert same(on, off) and len(on) == 3


def test_the_seed_validation_loop_keeps_at_most_one_batchs_activations() -> None:
    model = nn.Sequential(nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2)).eval()
    kept = []
    with findings() as got:
        for _ in range(6):
            score, k = keeps_activations(lambda: model(torch.randn(8, 4)))
            kept.append(k)
    assert kept == [True] + [False] * 5
    assert [w.category for w in got] == [EvalModeGradWarning]


@pytest.mark.parametrize("form", ["decorated", "with", "detach", "item"])
def test_a_forward_that_keeps_no_graph_itself_is_not_reported(form: str) -> None:
    class Scorer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> Any:
            if form == "decorated":
                return self.scored(x)
            if form == "with":
                with torch.no_grad():
                    return self.lin(x)
            return self.lin(x).detach() if form == "detach" else self.lin(x).sum().item()

        @torch.no_grad()
        def scored(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    safetorch.install(strict=True)
    model = Scorer().eval()
    with findings() as got:
        for _ in range(3):
            model(torch.ones(2, 3))
    assert got == []


def test_st008_names_the_users_loader_line_before_the_librarys() -> None:
    with findings() as got:
        model = fakehub.from_pretrained(); load = lineno()  # noqa: E702
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
    message = str(got[0].message)
    user = message.index(f"{__file__}:{load}")
    assert user < message.index(f"{fakehub.__file__}:{fakehub.EVAL_LINE}")
    assert message[message.index("put in eval mode by "):].startswith(
        "put in eval mode by `model = fakehub.from_pretrained(); load = lineno()")



class _OwnCall(nn.Module):
    """A class with its own __call__, as some libraries write one (logging, input conversion)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


def test_a_class_with_its_own_call_has_its_callers_lines_as_sites() -> None:
    def program() -> Any:
        torch.manual_seed(0)
        model = _OwnCall().eval()
        for _ in range(3):
            model(torch.randn(4, 3)).argmax(1)  # an evaluation, at its own line
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.randn(4, 3)).pow(2).mean()  # training in eval mode, from another line
            opt.zero_grad()
            loss.backward()
            opt.step()
        return weights(model)

    on, off = both(program)
    assert same(on, off)
    with findings() as got:
        model = _OwnCall().eval()
        for _ in range(3):
            model(torch.randn(4, 3)).argmax(1); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]
    assert str(got[0].message).startswith("ST003 model (_OwnCall)")


def test_st008_when_the_evaluation_comes_after_the_first_training_steps() -> None:
    """The program's eval(), two training steps (a choice, so far), a validation under no_grad, then training goes
    on without train(): the forgotten train() after validation."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with findings() as got:
        model.eval()
        for step in range(6):
            if step == 2:
                with torch.no_grad():
                    model(torch.randn(4, 3))
            loss = model(torch.randn(4, 3)).pow(2).mean(); line = lineno()  # noqa: E702
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(w.category, w.lineno) for w in got] == [(EvalModeTrainingWarning, line)]
