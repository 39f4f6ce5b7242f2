"""ST015: a freeze that freezes nothing (p.require_grad = False, module.requires_grad = False)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import FreezeDidNothingWarning, SafetorchError

from .conftest import findings, lineno


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_a_misspelt_parameter_attribute_warns_when_the_optimizer_is_built() -> None:
    model = _net()
    for p in model[0].parameters():
        p.require_grad = False
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(FreezeDidNothingWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST015 `p.require_grad = False` on 2 parameter(s) the optimizer holds set an attribute "
                              "torch never reads")
    assert "Write p.requires_grad = False" in message


def test_a_module_attribute_warns_naming_the_submodule() -> None:
    model = _net()
    model[0].requires_grad = False
    with findings() as got:
        torch.optim.Adam(model.parameters())
    assert [w.category for w in got] == [FreezeDidNothingWarning]
    message = str(got[0].message)
    assert message.startswith("ST015 `model.0.requires_grad = False` (Linear) set an attribute of the module, which "
                              "freezes nothing: 2 of its parameters the optimizer holds still require grad")
    assert "Write model.0.requires_grad_(False)" in message


def test_inside_a_method_the_module_is_found_through_self() -> None:
    class Trainer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = _net(), nn.Linear(2, 2)
            self.backbone.requires_grad = False

        def configure(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with findings() as got:
        Trainer().configure()
    assert [w.category for w in got] == [FreezeDidNothingWarning]
    assert "`self.backbone.requires_grad = False` (Sequential)" in str(got[0].message)


def test_look_alikes_stay_silent() -> None:
    class Embedding(nn.Module):
        """Stores its flag and applies it: nothing of it is trained."""

        def __init__(self, requires_grad: bool) -> None:
            super().__init__()
            self.requires_grad = requires_grad
            self.weight = nn.Parameter(torch.ones(3), requires_grad=requires_grad)

    model = _net()
    model[0].requires_grad_(False)
    for p in model[2].parameters():
        p.requires_grad = False
    frozen_embedding = Embedding(False)
    other = _net()
    other.requires_grad = False  # an attribute, but none of its parameters is in this optimizer
    with findings() as got:
        torch.optim.SGD([*model.parameters(), *frozen_embedding.parameters(), nn.Parameter(torch.ones(1))], lr=0.1)
    assert got == []


def test_strict_mode_raises_at_the_optimizer_line() -> None:
    safetorch.install(strict=True)
    model = _net()
    model.requires_grad = False
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        torch.optim.SGD(model.parameters(), lr=0.1)
    assert (info.value.code, info.value.lineno) == ("ST015", line)


def test_the_typo_program_trains_identically_on_and_off() -> None:
    """safetorch reports the freeze that froze nothing; it does not freeze anything itself."""
    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _net()
        model[0].requires_grad = False
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    with findings():
        on = train()
    safetorch.uninstall()
    off = train()
    safetorch.install()
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
