"""ST016: DDP replicas that differ across ranks. In-process, on a gloo group of one rank whose wrapper is told it has
a second rank: a stand-in for the job's store plays rank 1, writing rank 0's fingerprint back as rank 1's (changed
from a given step on). The 2-rank jobs, with real ranks, are in test_distributed.py."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import safetorch
from safetorch import ReplicasDivergedWarning, SafetorchError, _ddp, _deferred
from safetorch.checks import replicas_diverged

from .conftest import findings, lineno, one_rank_group

F = torch.nn.functional


class _Twin:
    """The job's store, with a rank 1 that publishes what rank 0 does (parameter ``which`` changed from step
    ``differ_from`` on), or nothing (``silent``)."""

    def __init__(self, differ_from: int | None = None, which: int = 0, silent: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.differ_from, self.which, self.silent = differ_from, which, silent
        self.sets = 0

    def set(self, key: str, value: bytes) -> None:
        self.sets += 1
        self.data[key] = value
        if key.endswith("/0") and not self.silent:
            step = int(key.split("/")[-2])
            if self.differ_from is not None and step >= self.differ_from:
                values = list(struct.unpack(f"<{len(value) // 8}d", value))
                values[self.which] += 1e-3
                value = struct.pack(f"<{len(values)}d", *values)
            self.data[key[:-1] + "1"] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


@pytest.fixture(autouse=True)
def _group() -> Iterator[None]:
    with one_rank_group():
        yield


def _train(store: _Twin | None, monkeypatch: pytest.MonkeyPatch, steps: int = 8,
           ranks: tuple[int, ...] = (0, 1)) -> tuple[list[torch.Tensor], int]:
    if store is not None:
        monkeypatch.setattr(replicas_diverged, "_store", lambda: store)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    entry = _ddp.live.get(id(model))
    if entry is not None:
        entry.ranks = ranks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    line = 0
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step(); line = lineno()  # noqa: E702
    return [p.detach().clone() for p in model.parameters()], line


def test_replicas_that_diverge_are_found_at_the_first_step_that_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    with findings() as got:
        on, line = _train(_Twin(differ_from=4, which=2), monkeypatch)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(ReplicasDivergedWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST016 the replicas of the DistributedDataParallel model differ across ranks when "
                              "step 4 begins: `2.weight` (and maybe more) on rank 1 is not rank 0's (identical when "
                              "step 3 began: its update made them differ")
    assert "rank-dependent code between backward() and step()" in message
    safetorch.uninstall()
    off, _ = _train(None, monkeypatch)
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_identical_replicas_are_silent_and_leave_nothing_in_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Twin()
    with findings() as got:
        _train(store, monkeypatch)
        safetorch.checks.replicas_diverged._final()
    assert got == []
    assert store.sets == 8 and store.data == {}  # one fingerprint a looked-at step, each deleted once compared


def test_a_rank_that_stops_publishing_blocks_nothing_and_keeps_the_store_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Twin(silent=True)
    with findings() as got:
        _train(store, monkeypatch, steps=40)
    assert got == []
    assert len(store.data) <= 8


def test_a_group_of_one_rank_is_never_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Twin(differ_from=1)
    with findings() as got:
        _train(store, monkeypatch, ranks=(0,))
    assert got == [] and store.sets == 0


def test_the_accelerator_path_publishes_once_the_device_is_done(device_path: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with findings() as got:
        _, line = _train(_Twin(differ_from=4), monkeypatch)
        _deferred.poll(wait=True)
    assert [(w.category, w.lineno) for w in got] == [(ReplicasDivergedWarning, line)]
    assert "when step 4 begins: `0.weight`" in str(got[0].message)


def test_strict_mode_raises_at_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    safetorch.install(strict=True)
    with pytest.raises(SafetorchError) as info:
        _train(_Twin(differ_from=2), monkeypatch)
    assert info.value.code == "ST016" and info.value.filename == __file__


def test_ignore_switches_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    safetorch.install(ignore=["replicas-diverged"])
    store = _Twin(differ_from=2)
    with findings() as got:
        _train(store, monkeypatch)
    assert got == [] and store.sets == 0


def test_buffers_are_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only parameters are fingerprinted: BatchNorm's running statistics may differ by rank.
    monkeypatch.setattr(replicas_diverged, "_store", lambda: _Twin())
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)))
    entry: Any = _ddp.live[id(model)]
    entry.ranks = (0, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    assert replicas_diverged._state(entry).names == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_per_line_suppression(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas_diverged, "_store", lambda: _Twin(differ_from=2))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    _ddp.live[id(model)].ranks = (0, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with findings() as got:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()  # safetorch: ignore[replicas-diverged]
    assert got == []
