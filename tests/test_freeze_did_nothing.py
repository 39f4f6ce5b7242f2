"""ST015: a freeze that freezes nothing (p.require_grad = False, module.requires_grad = False)."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import FreezeDidNothingWarning, SafetorchError

from .conftest import findings, lineno


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_a_misspelt_parameter_attribute_is_found_at_the_assignment_when_the_optimizer_is_built() -> None:
    model = _net()
    for param in model[0].parameters():
        param.require_grad = False; line = lineno()  # noqa: E702
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1); built = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(FreezeDidNothingWarning, __file__, line)]
    assert _text(got[0]) == (
        "ST015 `param.require_grad = False` sets an attribute torch never reads: the 2 parameter(s) it was set on "
        f"still require grad, and the optimizer built at {__file__}:{built} holds them, so they will be trained. "
        "Write: param.requires_grad = False (or module.requires_grad_(False))")


def test_a_module_attribute_is_found_at_the_assignment_naming_the_submodule() -> None:
    model = _net()
    model[0].requires_grad = False; line = lineno()  # noqa: E702
    with findings() as got:
        torch.optim.Adam(model.parameters()); built = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(FreezeDidNothingWarning, line)]
    assert _text(got[0]) == (
        "ST015 `model[0].requires_grad = False` (Linear) sets an attribute of the module, which freezes nothing: 2 "
        f"of its parameters still require grad, and the optimizer built at {__file__}:{built} holds them (model.0), "
        "so they will be trained. Write: model[0].requires_grad_(False)")


def test_a_suppression_comment_is_read_on_the_assignments_line() -> None:
    model, other = _net(), _net()
    model.requires_grad = False  # safetorch: ignore[ST015]
    other.requires_grad = False
    with findings() as got:
        torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)  # safetorch: ignore[ST015]
    assert [(w.lineno, _text(w).split(" = False")[0]) for w in got] == [(lineno() - 3, "ST015 `other.requires_grad")]


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
    assert "holds them (self.backbone), so they will be trained. Write: self.backbone.requires_grad_(False)" in \
        str(got[0].message)


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


def test_strict_mode_raises_when_the_optimizer_is_built_naming_the_assignment() -> None:
    safetorch.install(strict=True)
    model = _net()
    model.requires_grad = False; line = lineno()  # noqa: E702
    with pytest.raises(SafetorchError) as info:
        torch.optim.SGD(model.parameters(), lr=0.1)
    assert (info.value.code, info.value.filename, info.value.lineno) == ("ST015", __file__, line)
    ours = [entry.lineno + 1 for entry in info.traceback if entry.path == Path(__file__)]
    assert ours[-1] == line + 2  # raised from the optimizer's line, which proves it


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


def test_each_mistake_is_found_at_its_own_line() -> None:
    model = _net()
    for p in model[0].parameters():
        p.require_grad = False; typo_line = lineno()  # noqa: E702
    model[2].requires_grad = False; module_line = lineno()  # noqa: E702
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1)
    assert [(w.lineno, _text(w).rsplit("Write: ", 1)[1]) for w in got] == [
        (typo_line, "p.requires_grad = False (or module.requires_grad_(False))"),
        (module_line, "model[2].requires_grad_(False)")]


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
    assert sorted((w.lineno, _text(w).rsplit("Write: ", 1)[1]) for w in got) == [
        (trainer.line, "self.backbone.requires_grad_(False)"),
        (trainer.line + 2, "self.backbone[0].weight.requires_grad = False (or module.requires_grad_(False))"),
        (trainer.line + 3, "self.backbone[2].weight.requires_grad = False (or module.requires_grad_(False))"),
        (trainer.line + 4, "self.backbone[2].bias.requires_grad = False (or module.requires_grad_(False))")]
    assert "(Sequential) sets an attribute of the module, which freezes nothing: 4 of its parameters still require " \
        "grad, and the optimizer built at" in _text(next(w for w in got if w.lineno == trainer.line))


def test_a_flag_set_without_safetorch_is_reported_without_a_place() -> None:
    safetorch.uninstall()
    model = _net()
    model.requires_grad = False
    safetorch.install()
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1); line = lineno()  # noqa: E702
    assert [w.lineno for w in got] == [line]  # the optimizer's: the assignment's line is not known
    assert _text(got[0]).endswith("will be trained. Write: model.requires_grad_(False)")


def test_a_flag_torch_restores_from_a_pickle_names_no_line() -> None:
    """Unpickling a parameter sets its attributes from torch's code: that is not where the program wrote them."""
    p = nn.Parameter(torch.ones(2))
    p.require_grad = False
    loaded = pickle.loads(pickle.dumps(p))
    assert loaded.require_grad is False and loaded.requires_grad
    with findings() as got:
        torch.optim.SGD([loaded], lr=0.1); line = lineno()  # noqa: E702
    assert [w.lineno for w in got] == [line]
    assert _text(got[0]).endswith("Write: p.requires_grad = False (or module.requires_grad_(False)) where it was set")


def test_a_subclass_setattr_is_passed_to_the_line_that_assigned() -> None:
    class Logged(nn.Sequential):
        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, value)

    model = Logged(nn.Linear(2, 2))
    model.requires_grad = False; line = lineno()  # noqa: E702
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1)
    assert [w.lineno for w in got] == [line]
    assert _text(got[0]).endswith("Write: model.requires_grad_(False)")


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
