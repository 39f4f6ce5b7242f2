"""ST006: a NaN/Inf loss reaching backward(), reported at the backward line, on CPU directly and on CUDA later."""

from __future__ import annotations

import pytest
import torch

import safetorch
from safetorch import NonFiniteLossWarning, SafetorchError

from .conftest import findings, lineno


def test_nan_loss_warns_at_the_backward_line() -> None:
    w = torch.randn(3, requires_grad=True)
    loss = (w * float("nan")).sum()
    with findings() as got:
        loss.backward(); line = lineno()  # noqa: E702
    assert [(w_.category, w_.filename, w_.lineno) for w_ in got] == [(NonFiniteLossWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST006 loss is nan when backward() starts from it")
    for cause in ("learning rate", "log(0)", "division by zero", "bad data"):
        assert cause in message


def test_inf_and_autograd_backward_and_a_vector() -> None:
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        torch.autograd.backward((w.abs() * float("inf")).sum()); first = lineno()  # noqa: E702
        v = w * torch.tensor([1.0, float("nan"), float("inf")])
        v.backward(torch.ones(3)); second = lineno()  # noqa: E702
    assert [w_.lineno for w_ in got] == [first, second]
    assert "is inf" in str(got[0].message)
    assert "has 1 NaN and 1 infinite values among its 3 elements" in str(got[1].message)


def test_finite_losses_and_gradients_are_untouched() -> None:
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        (w * 2).sum().backward()
        torch.autograd.backward([(w ** 2).sum()])
    assert got == []
    assert torch.equal(w.grad, torch.full((3,), 2.0) + 2 * w.detach())


def test_a_finite_vector_backward_is_silent() -> None:
    # item() raises for a tensor of more than one element: the full finiteness test takes over, silently.
    w = torch.ones(3, requires_grad=True)
    with findings() as got:
        (w * 2).backward(torch.ones(3))
        (w[:0] * 2).backward(torch.ones(0))
    assert got == []
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_strict_mode_raises_before_backward_runs() -> None:
    safetorch.install(strict=True)
    w = torch.randn(3, requires_grad=True)
    loss = (w * float("nan")).sum()
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        loss.backward()
    assert (info.value.code, info.value.lineno) == ("ST006", line)
    assert w.grad is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reports_without_synchronising_at_the_next_step() -> None:
    from safetorch.checks import non_finite_loss

    model = torch.nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, device="cuda")
    with findings() as got:
        loss = model(x).sum() * float("nan")
        loss.backward(); line = lineno()  # noqa: E702
        assert len(non_finite_loss._pending) <= 1  # queued on the device, not read
        torch.cuda.synchronize()
        opt.step()  # the pre-step poll reads the completed flag
    assert [(w_.category, w_.lineno) for w_ in got] == [(NonFiniteLossWarning, line)]
