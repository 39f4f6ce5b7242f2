"""ST007: empty_cache() over and over from one line; an occasional call stays silent."""

from __future__ import annotations

import pytest
import torch

import safetorch
from safetorch import EmptyCacheLoopWarning, SafetorchError
from safetorch.checks import empty_cache_loop

from .conftest import findings, lineno


def test_every_iteration_warns_once_at_the_line() -> None:
    with findings() as got:
        for _ in range(30):
            torch.cuda.empty_cache(); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(EmptyCacheLoopWarning, __file__, line)]
    assert str(got[0].message).startswith("ST007 torch.cuda.empty_cache() has been called 10 times from this line")
    assert "Write: remove the call from the loop" in str(got[0].message)


def test_occasional_calls_are_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(empty_cache_loop, "_clock", lambda: now[0])
    with findings() as got:
        for _ in range(empty_cache_loop.THRESHOLD - 1):
            torch.cuda.empty_cache()  # nine times from one line: below the threshold
        for _epoch in range(50):
            now[0] += 120.0  # once per (two-minute) epoch: never ten within a minute
            torch.cuda.memory.empty_cache()
    assert got == []


def test_strict_mode_raises() -> None:
    safetorch.install(strict=True)
    with pytest.raises(SafetorchError) as info:
        for _ in range(20):
            torch.cuda.empty_cache()
    assert info.value.code == "ST007"
