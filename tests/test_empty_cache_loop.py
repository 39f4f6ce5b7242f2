"""ST007: empty_cache() over and over from one line, however slow the loop; an occasional call stays silent."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import safetorch
from safetorch import EmptyCacheLoopWarning, SafetorchError, _backward
from safetorch.checks import empty_cache_loop

from .conftest import findings, lineno


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """ST007's clock, set by the test: now[0] seconds."""
    now = [0.0]
    monkeypatch.setattr(empty_cache_loop, "_clock", lambda: now[0])
    return now


@pytest.fixture(autouse=True)
def _fresh_st007() -> None:
    """No run of an earlier test goes on, and no listener stands: as in a new process."""
    empty_cache_loop.uninstall()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 4), torch.randn(8, 2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
          micro_batches: int = 1) -> None:
    opt.zero_grad()
    for _ in range(micro_batches):
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_every_iteration_warns_once_at_the_line() -> None:
    with findings() as got:
        for _ in range(30):
            torch.cuda.empty_cache(); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EmptyCacheLoopWarning, __file__, line)]
    assert str(got[0].message).startswith("ST007 torch.cuda.empty_cache() has been called 10 times from this line "
                                          "within 60 s: it frees no memory")
    assert "Write: remove the call from the loop" in str(got[0].message)


def test_every_training_step_warns_however_slow_the_step(clock: list[float]) -> None:
    model, opt, x, y = _model()
    with findings() as got:
        for _ in range(12):
            clock[0] += 30.0  # 30 s a step: never 10 calls within a minute
            _step(model, opt, x, y)
            torch.cuda.empty_cache(); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EmptyCacheLoopWarning, __file__, line)]
    assert str(got[0].message).startswith(
        "ST007 torch.cuda.empty_cache() has been called from this line at every training step, 10 steps in a row: it "
        "frees no memory that live tensors hold")
    assert "Write: remove the call from the loop" in str(got[0].message)


def test_every_step_of_gradient_accumulation_warns(clock: list[float]) -> None:
    model, opt, x, y = _model()
    with findings() as got:
        for _ in range(10):
            clock[0] += 100.0
            _step(model, opt, x, y, micro_batches=4)
            torch.cuda.memory.empty_cache(); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(EmptyCacheLoopWarning, line)]
    assert "has been called from this line at every training step, 10 steps in a row" in str(got[0].message)


def test_numbers_are_unchanged(clock: list[float]) -> None:
    def train() -> list[torch.Tensor]:
        model, opt, x, y = _model()
        for _ in range(12):
            clock[0] += 30.0
            _step(model, opt, x, y)
            torch.cuda.empty_cache()
        return [p.detach().clone() for p in model.parameters()]

    safetorch.uninstall()
    expected = train()
    safetorch.install(strict=False, ignore=())
    with findings() as got:
        trained = train()
    assert [w.category for w in got] == [EmptyCacheLoopWarning]
    assert all(torch.equal(a, b) for a, b in zip(expected, trained, strict=True))


def test_occasional_calls_are_silent(clock: list[float]) -> None:
    with findings() as got:
        for _ in range(empty_cache_loop.THRESHOLD - 1):
            torch.cuda.empty_cache()  # nine times from one line: below the threshold
        for _epoch in range(50):
            clock[0] += 120.0  # once per (two-minute) epoch: never ten within a minute
            torch.cuda.memory.empty_cache()
    assert got == []


def _standing() -> bool:
    return empty_cache_loop.CODE in _backward._before


def test_once_after_loading_is_silent_and_leaves_no_listener() -> None:
    model, opt, x, y = _model()
    with findings() as got:
        torch.cuda.empty_cache()  # once, after building the model
        assert _standing()
        for _ in range(30):
            _step(model, opt, x, y)
    assert got == []
    assert not _standing()  # the backwards after the run's end pay nothing


@pytest.mark.parametrize("after_evaluation", [False, True], ids=["per-epoch", "after-evaluation"])
def test_once_per_epoch_is_silent_however_fast(after_evaluation: bool) -> None:
    model, opt, x, y = _model()  # the clock stands still: fifty epochs within a second
    with findings() as got:
        for _epoch in range(50):
            for _ in range(20):
                _step(model, opt, x, y)
            if after_evaluation:
                with torch.no_grad():
                    for _ in range(5):
                        model(x)
            torch.cuda.empty_cache()
        assert _standing()  # for a few backwards after the epoch's call
        for _ in range(empty_cache_loop.STEP_BACKWARDS + 1):
            _step(model, opt, x, y)
    assert got == []
    assert not _standing()


def test_a_program_that_never_calls_it_pays_nothing_per_step() -> None:
    model, opt, x, y = _model()
    for _ in range(5):
        _step(model, opt, x, y)
    assert not _standing()
    assert empty_cache_loop._state.backwards == 0  # no backward was counted


def _slow_training(clock: list[float]) -> Callable[[], int]:
    def train() -> int:
        model, opt, x, y = _model()
        for _ in range(10):
            clock[0] += 30.0
            _step(model, opt, x, y)
            torch.cuda.empty_cache(); line = lineno()  # noqa: E702
        return line

    return train


def test_strict_mode_raises() -> None:
    safetorch.install(strict=True)
    with pytest.raises(SafetorchError) as info:
        for _ in range(20):
            torch.cuda.empty_cache()
    assert info.value.code == "ST007"


def test_strict_mode_raises_on_a_slow_training_loop(clock: list[float]) -> None:
    safetorch.install(strict=True)
    with pytest.raises(SafetorchError) as info:
        _slow_training(clock)()
    user_line = next(entry.lineno + 1 for entry in info.traceback if entry.name == "train")  # entry.lineno: 0-based
    assert (info.value.code, info.value.filename, info.value.lineno) == ("ST007", __file__, user_line)
    assert "at every training step" in str(info.value)


def test_ignored_rule_is_silent_on_a_slow_training_loop(clock: list[float]) -> None:
    safetorch.install(ignore=["ST007"])
    with findings() as got:
        _slow_training(clock)()
    assert got == []
    assert not _standing()
