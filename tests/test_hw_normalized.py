"""HWNormalizedLoss and hw_normalized: the criterion's sum over H×W (or N×H×W), in 1-D, 2-D and 3-D."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safetorch.functional import hw_normalized
from safetorch.nn import HWNormalizedLoss

SPATIAL = {"1d": (7,), "2d": (5, 6), "3d": (3, 4, 5)}
N, C = 2, 4


def _case(kind: str, spatial: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(len(spatial))
    x = torch.randn(N, C, *spatial, generator=g, dtype=torch.float64)
    if kind == "class":
        t = torch.randint(0, C, (N, *spatial), generator=g)
        t[0, ...] = 1  # so that ignore_index=1 really ignores something
        return x, t
    if kind == "prob":
        return x, torch.rand(N, C, *spatial, generator=g, dtype=torch.float64)
    return x, torch.randn(N, C, *spatial, generator=g, dtype=torch.float64)


CRITERIA: dict[str, tuple[Callable[[str], nn.Module], str]] = {
    "CrossEntropyLoss(weight, ignore_index)": (
        lambda r: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64),
                                      ignore_index=1, reduction=r), "class"),
    "NLLLoss": (lambda r: nn.NLLLoss(reduction=r), "class"),
    "MSELoss": (lambda r: nn.MSELoss(reduction=r), "real"),
    "L1Loss": (lambda r: nn.L1Loss(reduction=r), "real"),
    "BCEWithLogitsLoss": (lambda r: nn.BCEWithLogitsLoss(reduction=r), "prob"),
}


def _value_and_grad(fn: Callable[..., torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> tuple[Any, Any]:
    x = x.clone().requires_grad_()
    value = fn(x, t)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


@pytest.mark.parametrize("dims", list(SPATIAL))
@pytest.mark.parametrize("name", list(CRITERIA))
@pytest.mark.parametrize("by", ["hw", "nhw"])
@pytest.mark.parametrize("inner", ["sum", "none"])
def test_module_matches_sum_divided_by_the_spatial_size(name: str, dims: str, by: str, inner: str) -> None:
    make, kind = CRITERIA[name]
    spatial = SPATIAL[dims]
    x, t = _case(kind, spatial)
    if name == "NLLLoss":
        x = x.log_softmax(1)
    size = torch.tensor(spatial).prod().item() * (N if by == "nhw" else 1)
    reference = make("sum")
    ours = HWNormalizedLoss(make(inner), by=by)
    value, grad = _value_and_grad(ours, x, t)
    want_value, want_grad = _value_and_grad(lambda a, b: reference(a, b) / size, x, t)
    assert torch.allclose(value, want_value) and torch.allclose(grad, want_grad)


@pytest.mark.parametrize("dims", list(SPATIAL))
@pytest.mark.parametrize("by", ["hw", "nhw"])
def test_functional_matches_and_passes_arguments_through(dims: str, by: str) -> None:
    spatial = SPATIAL[dims]
    x, t = _case("class", spatial)
    weight = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    size = torch.tensor(spatial).prod().item() * (N if by == "nhw" else 1)
    ours = hw_normalized(F.cross_entropy, by=by)

    def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(a, b, weight=weight, ignore_index=1, label_smoothing=0.1, reduction="sum") / size

    value, grad = _value_and_grad(lambda a, b: ours(a, b, weight=weight, ignore_index=1, label_smoothing=0.1), x, t)
    want_value, want_grad = _value_and_grad(reference, x, t)
    assert torch.allclose(value, want_value) and torch.allclose(grad, want_grad)
    mse = hw_normalized(F.mse_loss, by=by)
    y = torch.randn_like(x)
    assert torch.allclose(mse(x, y), F.mse_loss(x, y, reduction="sum") / size)
    assert ours.__name__ == "cross_entropy" and ours.__wrapped__ is F.cross_entropy  # type: ignore[attr-defined]


def test_the_seed_post_fix_without_a_hard_coded_size() -> None:
    score = torch.randn(2, 5, 128, 128, dtype=torch.float64)
    target = torch.randint(0, 5, (2, 128, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = nn.CrossEntropyLoss(size_average=False)  # the post's criterion: ST002 converts it to 'sum'
    assert legacy.reduction == "sum"
    criterion = HWNormalizedLoss(legacy)
    assert torch.allclose(criterion(score, target), legacy(score, target) / (128 * 128))
    small = torch.randn(2, 5, 64, 64, dtype=torch.float64)
    assert torch.allclose(criterion(small, target[:, :64, :64]), legacy(small, target[:, :64, :64]) / (64 * 64))


def test_an_averaging_criterion_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"averages already \(reduction='mean'\).*Write: HWNormalizedLoss\("
                                         r"CrossEntropyLoss\(reduction='sum'\), by='hw'\)"):
        HWNormalizedLoss(nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="batchmean"):
        HWNormalizedLoss(nn.KLDivLoss(reduction="batchmean"))
    with pytest.raises(ValueError, match="by='nhw'"):
        HWNormalizedLoss(nn.MSELoss(reduction="sum"), by="pixels")


def test_functional_refuses_another_reduction() -> None:
    f = hw_normalized(F.cross_entropy)
    x, t = _case("class", (4, 4))
    with pytest.raises(ValueError, match="reduction='mean'"):
        f(x, t, reduction="mean")
    with pytest.raises(ValueError, match="size_average=False"):
        f(x, t, None, False)
    assert torch.allclose(f(x, t, reduction="sum"), f(x, t))


@pytest.mark.parametrize("shape", [(4, 3), (4,), (2, 3, 0, 5), (2, 3, 4, 0)])
def test_inputs_without_spatial_size_are_refused_naming_the_shape(shape: tuple[int, ...]) -> None:
    criterion = HWNormalizedLoss(nn.MSELoss(reduction="sum"))
    x = torch.randn(*shape)
    with pytest.raises(ValueError, match=rf"shape {tuple(shape)!r}".replace("(", r"\(").replace(")", r"\)")):
        criterion(x, x)
    with pytest.raises(ValueError, match="shape"):
        hw_normalized(F.mse_loss)(x, x)


def test_shape_mismatch_keeps_torchs_error() -> None:
    criterion = HWNormalizedLoss(nn.CrossEntropyLoss(reduction="sum"))
    with pytest.raises(RuntimeError) as ours:
        criterion(torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 5, 5)))
    with pytest.raises(RuntimeError) as theirs:
        nn.CrossEntropyLoss(reduction="sum")(torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 5, 5)))
    assert str(ours.value) == str(theirs.value)


def test_lives_well_inside_a_model() -> None:
    weight = torch.tensor([1.0, 2.0, 3.0])
    criterion = HWNormalizedLoss(nn.CrossEntropyLoss(weight=weight, reduction="sum"), by="nhw")
    assert criterion.double() is criterion and criterion.to(torch.float32) is criterion
    assert list(criterion.state_dict()) == ["criterion.weight"]
    assert "CrossEntropyLoss()" in repr(criterion) and "by='nhw'" in repr(criterion)
    x, t = torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4))
    expected = criterion(x, t)
    for clone in (copy.deepcopy(criterion), pickle.loads(pickle.dumps(criterion))):
        assert torch.equal(clone(x, t), expected)
    buf = io.BytesIO()
    torch.save(criterion, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x, t), expected)
    state = io.BytesIO()
    torch.save(criterion.state_dict(), state)
    state.seek(0)
    fresh = HWNormalizedLoss(nn.CrossEntropyLoss(weight=torch.zeros(3), reduction="sum"), by="nhw")
    fresh.load_state_dict(torch.load(state))
    assert torch.equal(fresh(x, t), expected)


def test_no_graph_break_under_dynamo() -> None:
    import torch._dynamo

    criterion = HWNormalizedLoss(nn.CrossEntropyLoss(reduction="sum"))
    f = hw_normalized(F.mse_loss, by="nhw")

    def both(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return criterion(x, t) + f(x, y)

    x, t, y = torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4)), torch.randn(2, 3, 4, 4)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(both)(x, t, y)
    assert explanation.graph_break_count == 0
    assert torch.allclose(torch.compile(both, fullgraph=True, backend="eager")(x, t, y), both(x, t, y))
