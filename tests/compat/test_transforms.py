"""torch.compile, TorchScript, fx and export see the same program with safetorch installed."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import safetorch
from safetorch.functional import hw_normalized
from safetorch.nn import HWNormalizedLoss

from .models import EveryAPI, convnet, inputs


def _hw_losses() -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    criterion = HWNormalizedLoss(nn.CrossEntropyLoss(reduction="sum"))
    f = hw_normalized(F.mse_loss, by="nhw")

    def both(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return criterion(x, t) + f(x, x * 0.5)

    return both, (torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4)))


def _cases() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    cases: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {k: (m, (x,)) for k, (m, x) in inputs().items()}
    cases["hw_losses"] = _hw_losses()
    return cases


def _breaks(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[int, int]:
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = torch._dynamo.explain(fn)(*args)
    return e.graph_count, e.graph_break_count


@pytest.mark.parametrize("name", list(_cases()))
def test_graph_breaks_are_the_same_and_fullgraph_compiles(name: str) -> None:
    fn, args = _cases()[name]
    safetorch.uninstall()
    theirs = _breaks(fn, args)
    safetorch.install()
    ours = _breaks(fn, args)
    assert ours == theirs
    if theirs[1] == 0:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        torch.manual_seed(0)
        with torch.no_grad():
            expected = fn(*args)
            torch.manual_seed(0)
            got = compiled(*args)
        assert torch.allclose(got, expected)


@pytest.mark.parametrize("name", ["convnet", "every_api", "eval_convnet"])
def test_torchscript_fx_and_export_give_the_same_results(name: str) -> None:
    model, x = inputs()[name]
    model.eval()  # deterministic (dropout, batchnorm statistics)
    with torch.no_grad():
        expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = {
            "jit.script": torch.jit.script(model)(x),
            "jit.trace": torch.jit.trace(model, x)(x),
            "fx": torch.fx.symbolic_trace(model)(x),
            "export": torch.export.export(model, (x,)).module()(x),
        }
    for transform, value in results.items():
        assert torch.allclose(value, expected), transform


def test_a_training_step_through_torch_compile() -> None:
    model = EveryAPI()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    for _ in range(3):
        loss = compiled(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    assert convnet() is not None


def test_compiled_training_with_the_step_checks_compiles_the_same_graphs_and_numbers() -> None:
    """ST010/ST011 watch an optimizer's first steps (ST011 puts a tensor hook on a parameter until the next step):
    a compiled model trains to the same weights, with as many graphs and no finding."""
    from torch._dynamo.utils import counters

    def train() -> tuple[list[torch.Tensor], int]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, backend="eager")
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        for _ in range(10):
            opt.zero_grad()
            F.cross_entropy(compiled(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], counters["stats"]["unique_graphs"]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on, graphs_on = train()
    assert [w for w in caught if issubclass(w.category, safetorch.SafetorchWarning)] == []
    safetorch.uninstall()
    off, graphs_off = train()
    safetorch.install()
    assert graphs_on == graphs_off
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
