"""What a rule sees from a frame (`safetorch._visible`): the modules, and never a ``__dict__`` built to see them.

CPython 3.11 and 3.12 keep a plain object's attributes inline until something asks for its ``__dict__``; from then on
every attribute read of that object is slower. An optimizer read through ``__dict__`` at a looked-at step made
torch's own ``step`` and ``zero_grad`` cost the tiny MLP's loop 5.4k instructions a step pair.
"""

from __future__ import annotations

import gc
import re
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import FreezeDidNothingWarning, _visible

from .conftest import findings, lineno


def _built(obj: object, *names: str) -> bool:
    """Whether the object's ``__dict__`` was built: the garbage collector then sees a dict of its attribute names
    where it saw the attributes' values."""
    return any(type(r) is dict and all(n in r for n in names) for r in gc.get_referents(obj))


def _can_tell() -> bool:
    """Whether this Python shows a built ``__dict__`` to the garbage collector in place of inline values (3.11,
    3.12). 3.10 builds it with the first attribute; from 3.13 a built one leaves the values inline, where attribute
    reads stay as fast (``dis``'s adaptive view: LOAD_ATTR_INSTANCE_VALUE either way), and `_built` cannot see it."""
    class Probe:
        def __init__(self) -> None:
            self.a, self.b = 1, 2

    before, probe = Probe(), Probe()
    vars(probe)
    return not _built(before, "a", "b") and _built(probe, "a", "b")


needs_inline = pytest.mark.skipif(not _can_tell(), reason="only 3.11 and 3.12 trade inline values for a built __dict__")


class _Loop:
    """A trainer that holds its model and optimizer, as the frame of a looked-at step sees it (``self``)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.ReLU(), nn.Linear(8, 2))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.x, self.y = torch.randn(4, 8), torch.randint(0, 2, (4,))

    def run(self, steps: int) -> list[torch.Tensor]:
        self.model.train()
        for _ in range(steps):
            loss = nn.functional.cross_entropy(self.model(self.x), self.y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        return [p.detach().clone() for p in self.model.parameters()]


@needs_inline
def test_looked_at_steps_build_no_dict_for_the_optimizer_its_parameters_or_the_trainer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    held = _visible._held_modules

    def spy(value: object) -> list[tuple[str, nn.Module]]:
        seen.append(value)
        return held(value)

    monkeypatch.setattr(_visible, "_held_modules", spy)
    loop = _Loop()
    with findings() as got:
        on = loop.run(12)
    assert got == []
    assert any(v is loop for v in seen)  # the steps were looked at, and the trainer read for its modules
    assert not _built(loop.optimizer, "param_groups", "defaults")
    assert not _built(loop, "model", "optimizer")
    assert not any(_built(p) for p in loop.model.parameters())
    safetorch.uninstall()
    off = _Loop().run(12)
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


class _Holder:
    def __init__(self, net: nn.Module, other: nn.Module) -> None:
        self.name = "run"
        self.net = net
        self.count = 3
        self.backbone = other
        self.same = net


def test_a_holders_modules_are_named_in_the_order_vars_gives_them() -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    holder = _Holder(a, b)
    expected = [(k, v) for k, v in vars(_Holder(a, b)).items() if isinstance(v, nn.Module)]
    got = _visible._held_modules(holder)
    assert [(k, v) for k, v in got] == expected == [("net", a), ("backbone", b), ("same", a)]


def test_a_property_of_the_holder_is_never_run_to_name_a_module() -> None:
    ran: list[str] = []

    class Holder:
        def __init__(self) -> None:
            self.net = nn.Linear(1, 1)

        @property
        def net2(self) -> nn.Module:
            ran.append("net2")
            return self.net

    holder = Holder()
    assert _visible._held_modules(holder) == [("net", holder.net)]
    assert ran == []


def test_a_module_set_under_a_name_no_code_stores_is_named_from_dict() -> None:
    class Holder:
        def __init__(self, names: list[str]) -> None:
            for i, name in enumerate(names):
                setattr(self, name, nn.Linear(1, i + 1))

    holder = Holder(["encoder", "decoder"])
    assert [k for k, _ in _visible._held_modules(holder)] == ["encoder", "decoder"]


def test_a_dict_of_modules_is_not_descended_into_and_slots_are_not_attributes() -> None:
    class Holder:
        __slots__ = ("slot", "__dict__")

        def __init__(self) -> None:
            self.nets = {"g": nn.Linear(1, 1)}
            self.slot = nn.Linear(1, 1)
            self.plain = nn.Linear(1, 1)

    holder = Holder()
    assert _visible._held_modules(holder) == [("plain", holder.plain)]  # what vars(holder) gives
    assert _visible._held_modules(object()) == [] and _visible._held_modules([nn.Linear(1, 1)]) == []


def test_a_holder_whose_dict_was_built_is_read_from_it() -> None:
    holder = _Holder(nn.Linear(1, 1), nn.Linear(1, 1))
    vars(holder)["extra"] = nn.Linear(1, 1)
    assert [k for k, _ in _visible._held_modules(holder)] == ["net", "backbone", "same", "extra"]


def test_the_frames_modules_name_a_trainers_attributes() -> None:
    loop = _Loop()
    frame = sys._getframe()
    named = [(name, m) for name, m in _visible.modules(frame) if m is loop.model]
    assert named == [("loop.model", loop.model)]


def test_a_freeze_through_a_plain_trainer_is_named_by_its_attribute() -> None:
    class Trainer:
        def __init__(self) -> None:
            self.model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
            self.model.requires_grad = False
            self.line = lineno() - 1
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    with findings() as got:
        trainer = Trainer()
    assert [(w.category, w.lineno) for w in got] == [(FreezeDidNothingWarning, trainer.line)]
    text = re.sub(r" \(safetorch explain ST\d+\)$", "", str(got[0].message))
    assert "holds them (self.model)" in text and text.endswith("Write: self.model.requires_grad_(False)")


def test_a_parameters_misspelt_flag_is_still_found_and_a_plain_one_keeps_no_dict() -> None:
    model = nn.Linear(2, 2)
    model.weight.require_grad = False
    line = lineno() - 1
    with findings() as got:
        torch.optim.SGD(model.parameters(), lr=0.1)
    assert [(w.category, w.lineno) for w in got] == [(FreezeDidNothingWarning, line)]
    if _can_tell():
        assert not _built(model.bias)


class _Plain:
    """A forward's output that is neither a container, a mapping nor a dataclass."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _PlainOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> _Plain:
        return _Plain(self.body(x))


def test_an_evaluation_whose_model_returns_a_plain_object_is_found_at_its_line() -> None:
    """ST003 finds the graph through the object's attributes, read as the garbage collector reads them."""
    model = _PlainOut().eval()
    with findings() as got:
        for _ in range(3):
            out = model(torch.randn(4, 8)); line = lineno()  # noqa: E702
            assert out.logits.requires_grad
    assert [(w.category, w.filename, w.lineno) for w in got] == [(safetorch.EvalModeGradWarning, __file__, line)]


class _Loud:
    """A class attribute that raises on any attribute it does not have."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"read {name}")


def test_a_class_attribute_that_raises_on_reads_and_a_property_setter_are_handled() -> None:
    class Holder:
        loud = _Loud()

        def __init__(self) -> None:
            self.head = nn.Linear(1, 1)

        @property
        def body(self) -> nn.Module:
            return self._body

        @body.setter
        def body(self, value: nn.Module) -> None:
            self._body = value

    holder = Holder()
    holder.body = nn.Linear(1, 2)
    assert _visible._held_modules(holder) == [("head", holder.head), ("_body", holder._body)]


def _vars_modules(obj: object) -> list[tuple[str, nn.Module]]:
    """What the rules read before: the modules among ``vars(obj)``'s first 64 items (this builds the __dict__)."""
    return [(k, v) for k, v in list(vars(obj).items())[:64] if isinstance(v, nn.Module)]


def test_a_module_held_twice_or_under_a_name_set_from_outside_is_named_as_vars_names_it() -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 2)

    class TwoNames:
        def forward(self) -> Any:  # names the later attribute first
            return self.same, self.net

        def __init__(self) -> None:
            self.net, self.other, self.same = a, b, a

    class One:
        def __init__(self) -> None:
            self.net = a

    alias = One()
    alias.alias = a
    for make in (TwoNames, lambda: alias):
        holder, twin = make(), make()
        assert _visible._held_modules(holder) == _vars_modules(twin)
    assert [k for k, _ in _visible._held_modules(TwoNames())] == ["net", "other", "same"]


def test_st015_names_a_module_held_twice_by_its_first_name() -> None:
    class Trainer:
        def save(self) -> Any:
            return self.raw

        def __init__(self) -> None:
            self.model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
            self.raw = self.model
            self.model[0].requires_grad = False
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    with findings() as got:
        Trainer()
    assert len(got) == 1 and "holds them (self.model.0)" in str(got[0].message)


@needs_inline
def test_class_defaults_and_a_decorated_init_are_named_without_building_the_dict() -> None:
    class Defaults:
        model: nn.Module | None = None
        steps = 0

        @torch.no_grad()
        def __init__(self, model: nn.Module) -> None:
            self.model = model
            self.steps = 1

    holder = Defaults(nn.Linear(1, 1))
    assert _visible._held_modules(holder) == [("model", holder.model)]
    assert not _built(holder, "model", "steps")


def test_a_thread_locals_modules_are_found() -> None:
    import threading

    class Local(threading.local):
        def __init__(self) -> None:
            self.model = nn.Linear(1, 1)

    local = Local()
    local.extra = nn.Linear(1, 2)
    assert _visible._held_modules(local) == [("model", local.model), ("extra", local.extra)]


class _Meta(type):
    calls: list[str] = []

    def __hash__(cls) -> int:
        _Meta.calls.append("hash")
        raise RuntimeError("hash")

    def __eq__(cls, other: object) -> bool:
        _Meta.calls.append("eq")
        raise RuntimeError("eq")

    @property
    def __mro__(cls) -> Any:  # type: ignore[override]
        _Meta.calls.append("mro")
        raise RuntimeError("mro")


class _LoudProperty(property):
    @property  # type: ignore[misc]
    def fget(self) -> Any:  # type: ignore[override]
        _Meta.calls.append("fget")
        raise RuntimeError("fget")


class _Raising:
    @property  # type: ignore[misc]
    def __class__(self) -> Any:  # type: ignore[override]
        _Meta.calls.append("__class__")
        raise RuntimeError("__class__")


def test_a_hostile_class_runs_none_of_its_code_and_nothing_raises() -> None:
    class Holder(metaclass=_Meta):
        odd = _LoudProperty(lambda self: None)

        def __init__(self) -> None:
            self.net = nn.Linear(1, 1)
            self.table = {"x": _Raising()}

    holder = Holder()
    _Meta.calls.clear()
    assert _visible._held_modules(holder) == [("net", holder.net)]
    assert _Meta.calls == []
