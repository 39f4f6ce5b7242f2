"""ST004: `total += loss` into a Python number; ordinary arithmetic and per-step sums that only look similar stay
silent."""

from __future__ import annotations

import sys

import pytest
import torch

import safetorch
from safetorch import GraphAccumulationWarning, SafetorchError

from .conftest import findings, lineno


def make_loss() -> torch.Tensor:
    w = torch.randn(3, requires_grad=True)
    return (w * 2).sum()


def test_plus_equals_after_backward_warns_at_this_line_with_the_fix() -> None:
    total_loss = 0.0
    with findings() as got:
        for _ in range(3):
            loss = make_loss()
            loss.backward()
            total_loss += loss; line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GraphAccumulationWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST004 total_loss += loss adds a tensor that requires grad to a Python number")
    assert message.endswith("Write: total_loss += loss.item() (safetorch explain ST004)")
    assert isinstance(total_loss, torch.Tensor)  # the behaviour is unchanged: only reported


def test_same_name_stored_back_warns() -> None:
    loss = make_loss()
    loss.backward()
    acc = 0
    with findings() as got:
        acc = acc + loss; line = lineno()  # noqa: E702
    assert [w.lineno for w in got] == [line]
    assert str(got[0].message).endswith("Write: acc = acc + loss.item() (safetorch explain ST004)")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the addend's expression is read from co_positions() (3.11+); "
                    "3.10's message: test_without_columns_the_message_names_only_what_the_bytecode_proves")
def test_accumulating_before_backward_is_found_once_it_outlives_a_step() -> None:
    total = 0.0
    with findings() as got:
        for step in range(3):
            loss = make_loss()
            total += loss * 2; line = lineno()  # noqa: E702
            loss.backward()
            if step == 0:
                assert got == []  # one backward: it could still be this step's own term
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GraphAccumulationWarning, __file__, line)]
    assert str(got[0].message).endswith("Write: total += (loss * 2).item() (safetorch explain ST004)")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the addend's expression is read from co_positions() (3.11+); "
                    "3.10's message: test_without_columns_the_message_names_only_what_the_bytecode_proves")
def test_attribute_target_and_vector_value() -> None:
    class Meter:
        total = 0.0

    meter = Meter()
    w = torch.randn(3, requires_grad=True)
    v = w * 2
    v.backward(torch.ones(3))
    with findings() as got:
        meter.total += v
    assert str(got[0].message).endswith("Write: meter.total += v.detach() (safetorch explain ST004)")


def test_a_regularisation_term_built_each_step_is_silent() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with findings() as got:
        for _ in range(5):
            l2 = 0.0
            for p in model.parameters():
                l2 += p.norm()
            loss = model(torch.randn(8, 4)).pow(2).mean() + 1e-3 * l2
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert got == []
    assert all(p.grad is not None for p in model.parameters())


def test_look_alikes_are_silent() -> None:
    w = torch.randn(3, requires_grad=True)
    loss = (w * 2).sum()
    loss.backward(retain_graph=True)
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
        (y.sum() + scale.sum()).backward()
        (w * 3).sum().backward()
    assert got == []
    assert all(v is not None for v in (y, scale, z, s, t, u))


def test_in_a_function_and_once_per_site() -> None:
    def epoch() -> torch.Tensor:
        total = 0.0
        for _ in range(4):
            loss = make_loss()
            loss.backward()
            total += loss
        return total  # type: ignore[return-value]

    with findings() as got:
        epoch()
        epoch()
    assert len(got) == 1


def test_strict_mode_raises_on_this_line() -> None:
    safetorch.install(strict=True)
    loss = make_loss()
    loss.backward()
    total = 0.0
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        total += loss
    assert (info.value.code, info.value.lineno) == ("ST004", line)


def test_numbers_are_unchanged() -> None:
    loss = make_loss()
    assert torch.equal(1.5 + loss, torch.add(loss, 1.5))


def test_a_loss_backwarded_before_the_last_eight_is_still_found() -> None:
    """Only the last eight backwards are remembered for the immediate finding; an older one is caught by the watch."""
    losses = [make_loss() for _ in range(10)]
    for loss in losses:
        loss.backward()
    total = 0.0
    with findings() as got:
        total += losses[0]; line = lineno()  # noqa: E702
        assert got == []  # not among the last eight: watched, not yet reported
        for _ in range(2):
            make_loss().backward()
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GraphAccumulationWarning, __file__, line)]
    other = 0.0
    with findings() as got:
        other += losses[-1]; line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(GraphAccumulationWarning, line)]  # among the last eight: at once


@pytest.mark.python
def test_without_columns_the_message_names_only_what_the_bytecode_proves(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3.10 has no co_positions(): a line cannot say which of its statements runs. The names come from the bytecode
    # (the name stored back, a plain name added), or the message names none: it never invents one.
    from safetorch.checks import graph_accumulation

    monkeypatch.setattr(graph_accumulation, "call_source", lambda frame: None)
    loss = make_loss()
    loss.backward()
    total_loss, acc, other = 0.0, 0, 0.0
    box = type("Box", (), {"loss": loss})
    with findings() as got:
        total_loss += loss; other += 1.0  # noqa: E702
        acc = acc + loss
        other += box.loss
    messages = [str(w.message) for w in got]
    assert messages[0].startswith("ST004 total_loss += loss adds a tensor that requires grad to a Python number")
    assert messages[0].endswith("Write: total_loss += loss.item() (safetorch explain ST004)")
    assert messages[1].endswith("Write: acc = acc + loss.item() (safetorch explain ST004)")
    assert messages[2].startswith("ST004 a tensor that requires grad is added to a Python number (other): ")
    assert messages[2].endswith("Write: add the tensor's .item() instead of the tensor (safetorch explain ST004)")
    assert len(messages) == 3 and "total " not in " ".join(messages)
