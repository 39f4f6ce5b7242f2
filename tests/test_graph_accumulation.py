"""ST004: `total += loss` into a Python number; ordinary arithmetic that only looks similar stays silent."""

from __future__ import annotations

import pytest
import torch

import safetorch
from safetorch import GraphAccumulationWarning, SafetorchError

from .conftest import findings, lineno


def make_loss() -> torch.Tensor:
    w = torch.randn(3, requires_grad=True)
    return (w * 2).sum()


def test_plus_equals_warns_at_this_line_with_the_fix() -> None:
    loss = make_loss()
    total_loss = 0.0
    with findings() as got:
        for _ in range(3):
            total_loss += loss; line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GraphAccumulationWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST004 total_loss += loss adds a tensor that requires grad to a Python number")
    assert message.endswith("Write: total_loss += loss.item()")
    assert isinstance(total_loss, torch.Tensor)  # the behaviour is unchanged: only reported


def test_same_name_stored_back_warns() -> None:
    loss = make_loss()
    acc = 0
    with findings() as got:
        acc = acc + loss * 2; line = lineno()  # noqa: E702
    assert [w.lineno for w in got] == [line]
    assert str(got[0].message).endswith("Write: acc = acc + (loss * 2).item()")


def test_attribute_target_and_vector_value() -> None:
    class Meter:
        total = 0.0

    meter = Meter()
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        meter.total += w
    assert str(got[0].message).endswith("Write: meter.total += w.detach()")


def test_look_alikes_are_silent() -> None:
    w = torch.randn(3, requires_grad=True)
    loss = (w * 2).sum()
    acc = 0.0
    other = 0.0
    with findings() as got:
        y = 1 + w
        scale = 0.5 + w * 2
        acc += loss.item()
        acc += loss.detach()
        acc = acc + loss.item()
        z = other + loss  # a different name on the left
        s = sum([loss, loss])  # sum() starts from 0 inside the builtin
        t = 0.0
        t += torch.ones(2)  # no graph
        u = torch.zeros(())
        u += loss  # a tensor on the left: Tensor.__iadd__, not a Python number
    assert got == []
    assert all(v is not None for v in (y, scale, z, s, t, u))


def test_in_a_function_and_once_per_site() -> None:
    def epoch() -> torch.Tensor:
        total = 0.0
        for _ in range(4):
            total += make_loss()
        return total  # type: ignore[return-value]

    with findings() as got:
        epoch()
        epoch()
    assert len(got) == 1


def test_strict_mode_raises_on_this_line() -> None:
    safetorch.install(strict=True)
    loss = make_loss()
    total = 0.0
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        total += loss
    assert (info.value.code, info.value.lineno) == ("ST004", line)


def test_numbers_are_unchanged() -> None:
    loss = make_loss()
    assert torch.equal(1.5 + loss, torch.add(loss, 1.5))
