"""ST002: legacy size_average/reduce and reduction='elementwise_mean', converted exactly as torch does."""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import _reduction

import safetorch
from safetorch import LegacyReductionWarning, SafetorchError
from safetorch._patch import is_patch
from safetorch._report import reset
from safetorch.checks import legacy_reduction
from safetorch.checks.legacy_reduction import loss_classes, loss_functions

from .conftest import clean_env, findings, lineno

# torch's own notices about what these tests exercise on purpose (legacy losses, experimental dtypes)
pytestmark = [
    pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning"),
    pytest.mark.filterwarnings('ignore:`NLLLoss2d` has been deprecated:FutureWarning'),
    pytest.mark.filterwarnings('ignore:size_average and reduce args will be deprecated:UserWarning'),
]

COMBOS = list(itertools.product([None, True, False], repeat=2))
CLASSES = loss_classes()
FUNCTIONS = loss_functions()
TORCH_LEGACY = ("size_average and reduce args will be deprecated", "elementwise_mean' is deprecated")


def expected(size_average: bool | None, reduce: bool | None) -> str:
    if size_average is None and reduce is None:
        return "mean"
    return _reduction.legacy_get_string(size_average, reduce, emit_warning=False)


def test_discovery_finds_every_loss_by_introspection() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"CrossEntropyLoss", "NLLLoss", "NLLLoss2d", "BCELoss", "MSELoss", "TripletMarginLoss", "_Loss"} <= names
    assert "HuberLoss" not in names and "CTCLoss" not in names  # they take reduction= only
    every = [c for c in vars(nn.modules.loss).values() if isinstance(c, type) and issubclass(c, nn.modules.loss._Loss)]
    assert {c for c in every if "size_average" in inspect.signature(c.__init__).parameters} == set(CLASSES)
    assert {"nll_loss", "cross_entropy", "binary_cross_entropy", "kl_div", "triplet_margin_loss"} <= set(FUNCTIONS)
    assert all("size_average" in inspect.signature(f).parameters for f in FUNCTIONS.values())
    assert "huber_loss" not in FUNCTIONS


def _positional(signature: inspect.Signature, values: dict[str, Any], skip_first: bool) -> list[Any]:
    """Positional arguments up to and including `reduce`, defaults filling what `values` lacks."""
    params = list(signature.parameters.values())[1 if skip_first else 0:]
    out = []
    for p in params:
        out.append(values[p.name] if p.name in values else p.default)
        if p.name == "reduce":
            return out
    raise AssertionError("no reduce parameter")


def _no_torch_legacy_warning(caught: list[warnings.WarningMessage]) -> bool:
    return not any(any(t in str(w.message) for t in TORCH_LEGACY) for w in caught)


# Inputs for each concrete loss class: (args for forward), float64 so sums are exact enough to compare bitwise.
def _inputs(name: str) -> tuple[torch.Tensor, ...] | None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    y = torch.randn(4, 5, generator=g, dtype=torch.float64)
    cls = torch.tensor([1, 0, 4, 2])
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    table: dict[str, tuple[torch.Tensor, ...]] = {
        "L1Loss": (x, y), "MSELoss": (x, y), "SmoothL1Loss": (x, y), "SoftMarginLoss": (x, torch.sign(y)),
        "KLDivLoss": (x.log_softmax(1), y.softmax(1)), "PoissonNLLLoss": (x, y.abs()),
        "BCELoss": (x.sigmoid(), y.sigmoid()), "BCEWithLogitsLoss": (x, y.sigmoid()),
        "NLLLoss": (x.log_softmax(1), cls), "CrossEntropyLoss": (x, cls),
        "NLLLoss2d": (torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64).log_softmax(1),
                      torch.randint(0, 3, (2, 4, 4), generator=g)),
        "MultiLabelSoftMarginLoss": (x, (y > 0).double()),
        "MultiLabelMarginLoss": (x, torch.tensor([[3, 0, -1, 1, 0]] * 4)),
        "MultiMarginLoss": (x, cls), "HingeEmbeddingLoss": (x, torch.sign(y)),
        "MarginRankingLoss": (x[:, 0], y[:, 0], sign), "CosineEmbeddingLoss": (x, y, sign),
        "TripletMarginLoss": (x, y, torch.randn(4, 5, generator=g, dtype=torch.float64)),
    }
    return table.get(name)


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_every_loss_class_every_combination(cls: type[nn.Module]) -> None:
    inputs = _inputs(cls.__name__)
    if inputs is None:
        assert cls.__name__ in {"_Loss", "_WeightedLoss"}  # abstract bases: no forward of their own
    for (size_average, reduce), form in itertools.product(COMBOS, ["keyword", "positional"]):
        reset()
        legacy = {"size_average": size_average, "reduce": reduce}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if form == "keyword":
                module = cls(**legacy); line = lineno()  # noqa: E702
            else:
                module = cls(*_positional(inspect.signature(cls.__init__), legacy, True)); line = lineno()  # noqa: E702
        ours = [w for w in caught if issubclass(w.category, safetorch.SafetorchWarning)]
        want = expected(size_average, reduce)
        assert module.reduction == want, (size_average, reduce, form)
        if size_average is None and reduce is None:
            assert ours == []
        else:
            assert [(w.category, w.filename, w.lineno) for w in ours] == [(LegacyReductionWarning, __file__, line)]
            assert str(ours[0].message).startswith("ST002 ") and f"write reduction={want!r}" in str(ours[0].message)
        assert _no_torch_legacy_warning(caught)
        if inputs is not None:
            explicit = cls(reduction=want)
            assert torch.equal(module(*inputs), explicit(*inputs))


def test_message_names_the_replacement() -> None:
    with findings() as got:
        nn.CrossEntropyLoss(size_average=False)
    assert str(got[0].message).startswith("ST002 size_average=False is legacy: write reduction='sum'")
    with findings() as got:
        nn.NLLLoss(None, True, -100, False)
    assert str(got[0].message).startswith("ST002 size_average=True, reduce=False is legacy: write reduction='none'")
    assert "reduce=False overrides size_average" in str(got[0].message)


def test_elementwise_mean_is_stored_as_mean() -> None:
    with findings() as got:
        module = nn.MSELoss(reduction="elementwise_mean"); line = lineno()  # noqa: E702
    assert module.reduction == "mean"
    assert [(w.lineno, str(w.message)) for w in got] == [
        (line, "ST002 reduction='elementwise_mean' is legacy: write reduction='mean' in nn.MSELoss(...) "
               "(safetorch explain ST002)")]
    x, y = torch.randn(3), torch.randn(3)
    with findings() as got:
        value = F.mse_loss(x, y, reduction="elementwise_mean")
    assert torch.equal(value, F.mse_loss(x, y)) and len(got) == 1


def test_mixed_explicit_reduction_keeps_torchs_choice_and_says_so() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = nn.L1Loss(size_average=True, reduction="sum")
    assert module.reduction == "mean"  # torch: a legacy argument wins over reduction=
    message = str(caught[0].message)
    assert "overrides the reduction='sum' also given" in message
    assert _no_torch_legacy_warning(caught)


class LegacySubclass(nn.CrossEntropyLoss):
    def __init__(self) -> None:
        super().__init__(size_average=False); self.line = lineno()  # noqa: E702


class DirectSubclass(nn.modules.loss._Loss):
    def __init__(self) -> None:
        super().__init__(None, False); self.line = lineno()  # noqa: E702

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() if self.reduction == "sum" else x


def test_user_subclasses_passing_legacy_arguments_up() -> None:
    for cls, want in ((LegacySubclass, "sum"), (DirectSubclass, "none")):
        with findings() as got:
            module = cls()
        assert module.reduction == want
        assert [(w.category, w.filename, w.lineno) for w in got] == [(LegacyReductionWarning, __file__, module.line)]


def test_strict_mode_raises_on_this_line_and_converts_nothing() -> None:
    safetorch.install(strict=True)
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        nn.CrossEntropyLoss(size_average=False)
    assert (info.value.code, info.value.filename, info.value.lineno) == ("ST002", __file__, line)
    x, t = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(SafetorchError, match="^ST002 size_average=False is legacy"):
        F.cross_entropy(x, t, None, False)
    with pytest.raises(SafetorchError, match="^ST002 reduction='elementwise_mean' is legacy"):
        nn.MSELoss(reduction="elementwise_mean")


def test_once_per_call_site() -> None:
    with findings() as got:
        for _ in range(3):
            nn.MSELoss(size_average=False)
    assert len(got) == 1


def test_correct_calls_pass_through_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    # No wrapper frame between the user and a functional loss: torch's own warnings keep the user's line.
    assert all(not is_patch(vars(F)[name]) for name in FUNCTIONS)
    calls: list[int] = []
    monkeypatch.setattr(legacy_reduction, "_found", lambda *a: calls.append(1))
    model = nn.Linear(4, 3)
    criterion = nn.CrossEntropyLoss(weight=torch.ones(3), ignore_index=1, label_smoothing=0.1)
    for _ in range(3):
        loss = criterion(model(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1]))
        loss.backward()
        F.nll_loss(torch.randn(2, 3).log_softmax(1), torch.tensor([0, 2]), None, None, -100)
        F.mse_loss(torch.randn(3), torch.randn(3), reduction="sum")
    assert calls == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.kl_div(torch.randn(2, 3), torch.rand(2, 3)); line = lineno()  # noqa: E702
    assert [(w.filename, w.lineno) for w in caught if "batchmean" in str(w.message)] == [(__file__, line)]


@pytest.mark.parametrize("reduction", ["batchmean", "Mean", ["mean"], None])
def test_an_invalid_reduction_raises_torchs_own_error(reduction: Any) -> None:
    """What is not one of the three names reaches torch's ``get_enum``: its error, with no frame of safetorch's."""
    original = _reduction.get_enum.__wrapped__
    with pytest.raises(Exception) as expected:
        original(reduction)
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))) as got:
        F.cross_entropy(torch.randn(2, 3), torch.tensor([0, 2]), reduction=reduction)
    if sys.version_info >= (3, 11):  # on 3.10 a bare `raise` keeps the patch's frame (docs/limitations.md)
        assert not any("safetorch" in str(entry.path) for entry in got.traceback[1:])


_SCRIPTED_LOSSES = """
import typing, warnings
vars(typing).pop("warnings", None)  # present on some Pythons only: nothing may depend on it
import torch, torch.nn as nn, torch.nn.functional as F
import safetorch

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.criterion = nn.Linear(3, 2), nn.CrossEntropyLoss()

    def forward(self, x, y):
        logits = self.fc(x)
        return self.criterion(logits, y) + F.nll_loss(logits.log_softmax(1), y) + F.mse_loss(logits, logits.detach())

warnings.simplefilter("ignore", FutureWarning)  # torch 2.10+ deprecates torch.jit.script
warnings.simplefilter("ignore", DeprecationWarning)
torch.manual_seed(0)
model, x, y = Model(), torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
scripted = torch.jit.script(model)
print(torch.equal(scripted(x, y), model(x, y)), F.cross_entropy.__module__)
"""


@pytest.mark.python
def test_torchscript_compiles_a_forward_that_calls_losses(tmp_path: Path) -> None:
    # TorchScript compiles get_enum from torch's source and resolves its names in the replacement's globals, which
    # must be torch's: ``warnings`` reached safetorch's module through ``typing`` on 3.11 and 3.12 only.
    program = tmp_path / "scripted.py"
    program.write_text(_SCRIPTED_LOSSES)
    proc = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=clean_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "torch.nn.functional"]


# --- functions, with torch's own op_db sample inputs -----------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _op_db() -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {op.name: op for op in op_db}


def _samples(name: str, limit: int | None = None) -> list[Any]:
    op = _op_db()[f"nn.functional.{name}"]
    samples = list(op.sample_inputs("cpu", torch.float64, requires_grad=False))
    return samples[:limit] if limit else samples


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_every_loss_function_every_combination(name: str) -> None:
    fn = getattr(F, name)
    signature = inspect.signature(FUNCTIONS[name])
    for sample in _samples(name, limit=3):
        kwargs = {k: v for k, v in sample.kwargs.items() if k != "reduction"}
        for (size_average, reduce), form in itertools.product(COMBOS, ["keyword", "positional"]):
            reset()
            want = expected(size_average, reduce)
            reference = fn(sample.input, *sample.args, reduction=want, **kwargs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if form == "keyword":
                    value = fn(sample.input, *sample.args, size_average=size_average, reduce=reduce, **kwargs)
                    line = lineno() - 1
                else:
                    named = dict(zip(signature.parameters, (sample.input, *sample.args), strict=False))
                    named.update(kwargs, size_average=size_average, reduce=reduce)
                    positional = _positional(signature, named, False)
                    rest = {k: v for k, v in kwargs.items() if k not in signature.parameters
                            or list(signature.parameters).index(k) > list(signature.parameters).index("reduce")}
                    value = fn(*positional, **rest); line = lineno()  # noqa: E702
            ours = [w for w in caught if issubclass(w.category, safetorch.SafetorchWarning)]
            assert torch.equal(value, reference), (name, size_average, reduce, form)
            if size_average is None and reduce is None:
                assert ours == []
            else:
                assert [(w.category, w.filename, w.lineno) for w in ours] == [(LegacyReductionWarning, __file__, line)]
                assert f"write reduction={want!r} in F.{name}(...)" in str(ours[0].message)
            assert _no_torch_legacy_warning(caught)


def _grads(fn: Any, sample: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    leaves = [t for t in (sample.input, *sample.args, *sample.kwargs.values())
              if isinstance(t, torch.Tensor) and t.requires_grad]
    out = fn(sample.input, *sample.args, **sample.kwargs)
    grads = list(torch.autograd.grad(out.sum(), leaves, allow_unused=True)) if out.requires_grad else []
    return out.detach(), grads


@pytest.mark.slow
def test_op_db_loss_samples_are_identical_with_and_without_safetorch() -> None:
    names = sorted({n.removeprefix("nn.functional.") for n in _op_db()
                    if n.startswith("nn.functional.") and n.endswith("loss")} | set(FUNCTIONS))
    ran = 0
    for name in names:
        fn = getattr(F, name)
        op = _op_db()[f"nn.functional.{name}"]
        for sample in op.sample_inputs("cpu", torch.float64, requires_grad=op.supports_autograd):
            safetorch.uninstall()
            torch.manual_seed(0)
            bare = _grads(fn, sample)
            safetorch.install()
            torch.manual_seed(0)
            with findings() as got:
                ours = _grads(getattr(F, name), sample)
            assert got == []
            assert torch.equal(bare[0], ours[0]), name
            for a, b in zip(bare[1], ours[1], strict=True):
                assert (a is None and b is None) or torch.equal(a, b), name
            ran += 1
    assert ran > 200  # every sample of every nn.functional loss in op_db
