"""ST015: a freeze that freezes nothing (p.require_grad = False, module.requires_grad = False)."""

from __future__ import annotations

import pickle
import re
import warnings

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


def _text(w: warnings.WarningMessage) -> str:
    """A finding's message without the pointer to the rule's page the reporter ends it with, where it does."""
    return re.sub(r" \(safetorch explain ST\d+\)$", "", str(w.message))


def test_the_message_names_the_line_that_set_the_attribute() -> None:
    model = _net()
    for p in model[0].parameters():
        p.require_grad = False; typo_line = lineno()  # noqa: E702
    model[2].requires_grad = False; module_line = lineno()  # noqa: E702
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1)
    assert _text(got[0]) == (
        "ST015 `p.require_grad = False` on 2 parameter(s) the optimizer holds set an attribute torch never reads: "
        "they still require grad and will be trained. Write p.requires_grad = False (or "
        f"module.requires_grad_(False)) in its place, at {__file__}:{typo_line}; and `model.2.requires_grad = False` "
        "(Linear) set an attribute of the module, which freezes nothing: 2 of its parameters the optimizer holds "
        f"still require grad and will be trained. Write model.2.requires_grad_(False) in its place, at "
        f"{__file__}:{module_line}")


def test_the_setters_line_is_found_in_another_method_and_for_each_parameter() -> None:
    class Trainer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = _net()
            self.backbone.requires_grad = False
            self.line = lineno() - 1
            self.backbone[0].weight.require_grad = False
            self.backbone[2].weight.require_grad = False
            self.backbone[2].bias.require_grad = False

    trainer = Trainer()
    with findings() as got:
        torch.optim.SGD(trainer.parameters(), lr=0.1)
    message = _text(got[0])
    assert (f"Write trainer.backbone.requires_grad_(False) in its place, at {__file__}:{trainer.line}"
            in message)
    assert (f"(or module.requires_grad_(False)) in its place, at {__file__}:{trainer.line + 2}, "
            f"{__file__}:{trainer.line + 3}, {__file__}:{trainer.line + 4}; and " in message)


def test_a_flag_set_without_safetorch_is_reported_without_a_place() -> None:
    safetorch.uninstall()
    model = _net()
    model.requires_grad = False
    safetorch.install()
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1)
    assert _text(got[0]).endswith("will be trained. Write model.requires_grad_(False)")


def test_a_flag_torch_restores_from_a_pickle_names_no_line() -> None:
    """Unpickling a parameter sets its attributes from torch's code: that is not where the program wrote them."""
    p = nn.Parameter(torch.ones(2))
    p.require_grad = False
    loaded = pickle.loads(pickle.dumps(p))
    assert loaded.require_grad is False and loaded.requires_grad
    with findings() as got:
        torch.optim.SGD([loaded], lr=0.1)
    assert _text(got[0]).endswith("Write p.requires_grad = False (or module.requires_grad_(False))")


def test_a_subclass_setattr_is_passed_to_the_line_that_assigned() -> None:
    class Logged(nn.Sequential):
        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, value)

    model = Logged(nn.Linear(2, 2))
    model.requires_grad = False; line = lineno()  # noqa: E702
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1)
    assert _text(got[0]).endswith(f"Write model.requires_grad_(False) in its place, at {__file__}:{line}")


def test_the_recorded_attributes_behave_as_plain_ones_and_uninstall_removes_them() -> None:
    class Flagged:
        @property
        def require_grad(self) -> str:
            return "the mixin's"

    class FlaggedTensor(torch.Tensor, Flagged):  # a class after torch.Tensor in the MRO keeps its meaning
        pass

    assert torch.ones(2).as_subclass(FlaggedTensor).require_grad == "the mixin's"
    module, t = nn.Linear(2, 2), torch.ones(2)
    assert not hasattr(module, "requires_grad") and not hasattr(t, "require_grad")
    with pytest.raises(AttributeError, match="'Tensor' object has no attribute 'require_grad'"):
        t.require_grad  # noqa: B018
    for name in dir(module):  # as torch.compile reads a module's attributes: no class attribute raises
        getattr(module, name)
    module.requires_grad, t.require_grad = False, False
    assert (module.requires_grad, t.require_grad, t.requires_grad) == (False, False, False)
    assert vars(module)["requires_grad"] is False and vars(t) == {"require_grad": False}
    del t.require_grad
    assert not hasattr(t, "require_grad")
    t.require_grad = False
    safetorch.uninstall()
    assert "require_grad" not in vars(torch.Tensor) and "requires_grad" not in vars(nn.Module)
    assert nn.Module.__setattr__.__code__.co_filename == torch.nn.modules.module.__file__
    assert module.requires_grad is False and t.require_grad is False
    assert torch.Tensor.requires_grad is torch._C.TensorBase.requires_grad  # torch's own, never replaced
