"""ST009: softmax/sigmoid output fed to a loss that wants logits (or softmax into nll_loss)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import safetorch
from safetorch import ProbabilitiesIntoLogitsLossWarning, SafetorchError

from .conftest import findings, lineno


def _logits() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 3, requires_grad=True), torch.randint(0, 3, (4,))


def test_softmax_into_cross_entropy_warns_at_the_loss_line_naming_the_argument() -> None:
    logits, y = _logits()
    probs = F.softmax(logits, dim=1)
    with findings() as got:
        loss = F.cross_entropy(probs, y); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(ProbabilitiesIntoLogitsLossWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST009 cross_entropy() got `probs`, the output of softmax(): it applies log_softmax")
    assert "Pass the logits" in message
    assert torch.equal(loss, F.cross_entropy(probs.detach(), y))  # the numbers are torch's


BUGS: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]] = {
    "nn.CrossEntropyLoss(softmax)": (lambda x, y: nn.CrossEntropyLoss()(x.softmax(1), y), "cross_entropy() got"),
    "softmax then a view": (lambda x, y: F.cross_entropy(F.softmax(x, -1).view(4, 3).clone(), y), "softmax()"),
    "nll_loss(softmax)": (lambda x, y: F.nll_loss(torch.softmax(x, 1), y), "nll_loss wants log-probabilities"),
    "nn.NLLLoss(softmax)": (lambda x, y: nn.NLLLoss()(x.softmax(dim=1), y), "nll_loss wants log-probabilities"),
    "nll_loss(log_softmax(dim=0))": (lambda x, y: F.nll_loss(F.log_softmax(x, dim=0), y), "over dim=0"),
    "bce_with_logits(sigmoid)": (lambda x, y: F.binary_cross_entropy_with_logits(x.sigmoid(), torch.ones(4, 3)),
                                 "the output of sigmoid()"),
    "nn.BCEWithLogitsLoss(sigmoid)": (lambda x, y: nn.BCEWithLogitsLoss()(torch.sigmoid(x), torch.ones(4, 3)),
                                      "applies sigmoid itself"),
}


@pytest.mark.parametrize("name", BUGS)
def test_every_form_of_the_mistake(name: str) -> None:
    logits, y = _logits()
    call, phrase = BUGS[name]
    with findings() as got:
        call(logits, y)
    assert [w.category for w in got] == [ProbabilitiesIntoLogitsLossWarning]
    assert phrase in str(got[0].message)


LOOK_ALIKES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "raw logits": lambda x, y: F.cross_entropy(x, y),
    "log_softmax(dim=1) into nll_loss": lambda x, y: F.nll_loss(F.log_softmax(x, dim=1), y),
    "log_softmax(dim=-1) into nll_loss": lambda x, y: F.nll_loss(x.log_softmax(-1), y),
    "log(probs) into nll_loss": lambda x, y: F.nll_loss(torch.log(F.softmax(x, 1)), y),
    "softmaxed targets (distillation)": lambda x, y: F.cross_entropy(x, F.softmax(x.detach() * 2, 1)),
    "kl_div on log_softmax and softmax": lambda x, y: F.kl_div(F.log_softmax(x, 1), F.softmax(x, 1),
                                                              reduction="batchmean"),
    "sigmoid into binary_cross_entropy": lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), torch.ones(4, 3)),
    "logits into bce_with_logits": lambda x, y: F.binary_cross_entropy_with_logits(x, torch.sigmoid(x.detach())),
    "a 4-D segmentation log_softmax over channels": lambda x, y: F.nll_loss(
        F.log_softmax(x.view(1, 3, 2, 2), dim=1), y.view(1, 2, 2)),
}


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alikes_stay_silent_with_the_same_numbers(name: str) -> None:
    logits, y = _logits()
    with findings() as got:
        on = LOOK_ALIKES[name](logits, y)
        on.backward()
    assert got == []
    grad_on = logits.grad.clone()
    safetorch.uninstall()
    logits.grad = None
    off = LOOK_ALIKES[name](logits, y)
    off.backward()
    safetorch.install()
    assert torch.equal(on, off) and torch.equal(grad_on, logits.grad)


def test_under_no_grad_it_is_not_looked_at() -> None:
    logits, y = _logits()
    with findings() as got, torch.no_grad():
        F.cross_entropy(F.softmax(logits, 1), y)
        F.cross_entropy(F.softmax(logits, 1).requires_grad_(), y)
    assert got == []


def test_strict_mode_raises_before_the_loss() -> None:
    safetorch.install(strict=True)
    logits, y = _logits()
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        nn.CrossEntropyLoss()(logits.softmax(1), y)
    assert (info.value.code, info.value.lineno) == ("ST009", line)


def test_per_line_suppression() -> None:
    logits, y = _logits()
    with findings() as got:
        F.cross_entropy(logits.softmax(1), y)  # safetorch: ignore[ST009]
    assert got == []


def test_after_the_first_calls_a_new_mistake_is_seen_within_the_sample() -> None:
    """The first losses are looked at, then one call in EVERY on average, never more than 2 * EVERY - 1 apart: a
    line that first runs late (a second phase of training) is still reported, within that many calls."""
    from safetorch import _losses as rule

    logits, y = _logits()
    with findings() as got:
        for _ in range(rule.FIRST + 5):
            F.nll_loss(F.log_softmax(logits, 1), y)
        for _ in range(2 * rule.EVERY - 1):
            F.nll_loss(F.softmax(logits, 1), y); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(ProbabilitiesIntoLogitsLossWarning, line)]


def test_a_late_mistake_in_one_of_two_losses_per_step_is_seen() -> None:
    """Two losses per step, the first wrong only from a late phase on: a fixed even sampling period (every 16th
    call) lands on the second loss only, for ever; varying intervals land on the first within a few samples."""
    from safetorch import _losses as rule

    logits, y = _logits()
    with findings() as got:
        for _ in range(rule.FIRST):
            F.cross_entropy(logits, y)
            F.cross_entropy(logits, y)
        for _ in range(8 * rule.EVERY):
            F.cross_entropy(logits.softmax(1), y); line = lineno()  # noqa: E702
            F.cross_entropy(logits, y)
    assert [(w.category, w.lineno) for w in got] == [(ProbabilitiesIntoLogitsLossWarning, line)]


class _SoftmaxNet(nn.Module):
    """The shape of danielkelshaw/ConcreteDropout's mnist_example.py before PR #12 (issue #11): the model's forward
    ends in softmax, and train() gives its output to F.cross_entropy."""

    line = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.relu(self.fc1(x)))
        _SoftmaxNet.line = lineno() + 1
        return F.softmax(out, dim=1)


def _train_concrete_dropout(model: nn.Module, steps: int = 2) -> None:
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data, target = torch.randn(4, 4), torch.randint(0, 3, (4,))
    for _ in range(steps):
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()


def test_a_forward_that_returns_softmax_is_reported_at_its_softmax_line() -> None:
    """ConcreteDropout#12 removed the forward's softmax line: that is the line the finding names, not the loss's."""
    with findings() as got:
        _train_concrete_dropout(_SoftmaxNet())
    assert [(w.category, w.filename, w.lineno) for w in got] == [
        (ProbabilitiesIntoLogitsLossWarning, __file__, _SoftmaxNet.line)]
    message = str(got[0].message)
    assert message.startswith("ST009 cross_entropy() got `output`, the output of softmax()")
    assert "Here _SoftmaxNet.forward returns the output of softmax(), which cross_entropy() at " \
           "test_probabilities_into_logits.py:" in message
    assert message.endswith("return the logits from forward, and apply softmax() where probabilities are read "
                            "(safetorch explain ST009)")


def test_a_softmax_in_the_loss_function_itself_stays_at_the_loss_line() -> None:
    model = nn.Linear(4, 3)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    with findings() as got:
        probs = model(x).softmax(dim=1)
        F.cross_entropy(probs, y); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(ProbabilitiesIntoLogitsLossWarning, line)]


def test_a_gnn_loss_on_one_element_of_an_iterated_softmax_is_found() -> None:
    """The shape of a GNN's per-graph loss: `for out in F.softmax(logits, dim=-1)` iterates by unbind (grad_fn
    UnbindBackward0), and one element at a time reaches cross_entropy; `outputs[i]` (SelectBackward0) was found."""
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 2, 4, requires_grad=True), torch.randint(0, 4, (3, 2))
    total = torch.zeros(())
    with findings() as got:
        for out, target in zip(F.softmax(logits, dim=-1), targets, strict=True):
            total = total + F.cross_entropy(out, target); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(ProbabilitiesIntoLogitsLossWarning, line)]
    assert str(got[0].message).startswith("ST009 cross_entropy() got `out`, the output of softmax()")
    # chunk() and split() pieces are the same mistake; logits iterated are not
    with findings() as got:
        F.cross_entropy(F.softmax(logits, dim=-1).chunk(3)[0][0], targets[0])
        for out, target in zip(logits, targets, strict=True):
            F.cross_entropy(out, target)
    assert len(got) == 1
