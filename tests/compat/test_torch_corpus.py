"""torch's own corpus: every module_db module and every op_db conversion/loss, with safetorch off and on.

Outputs and gradients must be bit-identical (``torch.equal``), in train mode and in eval mode under no_grad. The
counts of what ran are asserted and written to the terminal summary (see conftest), and every skip has a reason.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch

import safetorch

from . import COUNTS

# torch's own notices about what these tests exercise on purpose (legacy losses, experimental dtypes)
pytestmark = [
    pytest.mark.slow,  # torch's whole module and op corpus: minutes
    pytest.mark.filterwarnings('ignore:ComplexHalf support is experimental:UserWarning'),
    pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning"),
]


@functools.lru_cache(maxsize=1)
def _module_db() -> list[Any]:
    from torch.testing._internal.common_modules import module_db

    return list(module_db)


@functools.lru_cache(maxsize=1)
def _op_db() -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {op.name: op for op in op_db}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t).sum() if t.is_complex() else t.sum()


def _equal(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if x is not y:
                return False
        elif x.layout != torch.strided or y.layout != torch.strided:
            if not torch.equal(x.to_dense(), y.to_dense()):
                return False
        elif x.dtype != y.dtype or x.shape != y.shape:
            return False
        else:  # bitwise: NaNs at the same places count as equal
            xv = torch.view_as_real(x.to(torch.complex64) if x.dtype == torch.complex32 else x) if x.is_complex() else x
            yv = torch.view_as_real(y.to(torch.complex64) if y.dtype == torch.complex32 else y) if y.is_complex() else y
            if not (torch.equal(xv.isnan(), yv.isnan()) and torch.equal(xv.nan_to_num(), yv.nan_to_num())):
                return False
    return True


def _run_module(info: Any, sample: Any, training: bool) -> tuple[list[Any], list[Any]]:
    torch.manual_seed(0)
    args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
    module = info.module_cls(*args, **kwargs).to(torch.float64)
    module.train(training)
    fargs, fkwargs = sample.forward_input.args, sample.forward_input.kwargs
    if training:
        torch.manual_seed(1)
        out = module(*fargs, **fkwargs)
        outs = [t for t in _tensors(out) if t.is_floating_point() or t.is_complex()]
        params = [p for p in module.parameters() if p.requires_grad]
        inputs = [t for t in _tensors((fargs, fkwargs)) if t.requires_grad]
        wrt = params + inputs
        diff = [o for o in outs if o.requires_grad]
        grads = list(torch.autograd.grad([_scalar(o) for o in diff], wrt, allow_unused=True)) if diff and wrt else []
        return [o.detach() for o in outs], grads
    with torch.no_grad():
        torch.manual_seed(1)
        out = module(*fargs, **fkwargs)
    return [t for t in _tensors(out) if t.is_floating_point() or t.is_complex()], []


def _module_cases() -> list[tuple[Any, str]]:
    return [(info, mode) for info in _module_db() for mode in ("train", "eval")]


@pytest.mark.parametrize(("info", "mode"), _module_cases(),
                         ids=[f"{i.module_cls.__name__}-{m}" for i, m in _module_cases()])
def test_module_db_is_identical_with_and_without_safetorch(info: Any, mode: str) -> None:
    if torch.float64 not in info.dtypes:
        pytest.skip(f"{info.module_cls.__name__} has no float64 samples")
    training = mode == "train"
    try:
        samples = info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=training,
                                          training=training)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"torch's sample inputs for {info.module_cls.__name__} cannot be built here: {exc}")
    ran = 0
    for sample in samples:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            safetorch.uninstall()
            try:
                bare = _run_module(info, sample, training)
            except Exception as exc:  # noqa: BLE001  (an invalid sample fails the same way with safetorch on)
                safetorch.install()
                with pytest.raises(type(exc)):
                    _run_module(info, sample, training)
                continue
            safetorch.install()
            ours = _run_module(info, sample, training)
        assert _equal(bare[0], ours[0]), f"{info.module_cls.__name__} {mode}: outputs differ ({sample.desc})"
        assert _equal(bare[1], ours[1]), f"{info.module_cls.__name__} {mode}: gradients differ ({sample.desc})"
        ran += 1
    COUNTS["modules"].add(info.module_cls.__name__)
    COUNTS["module samples"] += ran


CONVERSIONS = ["to", "float", "double", "half", "bfloat16", "long", "int", "short", "bool", "byte", "char",
               "contiguous", "clone", "cfloat", "cdouble", "chalf", "to_sparse", "__radd__"]


@pytest.mark.parametrize("name", CONVERSIONS)
def test_op_db_conversions_are_identical_with_and_without_safetorch(name: str) -> None:
    op = _op_db()[name]
    ran = 0
    for dtype in (torch.float32, torch.float64, torch.int64):
        if dtype not in op.supported_dtypes("cpu"):
            continue
        grad = op.supports_autograd and dtype.is_floating_point
        for sample in op.sample_inputs("cpu", dtype, requires_grad=grad):
            results = []
            for state in ("off", "on"):
                (safetorch.install if state == "on" else safetorch.uninstall)()
                out = op(sample.input, *sample.args, **sample.kwargs)
                outs = _tensors(out)
                leaves = [t for t in _tensors((sample.input, sample.args, sample.kwargs)) if t.requires_grad]
                diff = [o for o in outs if o.requires_grad and o.layout == torch.strided]
                grads = list(torch.autograd.grad([_scalar(o) for o in diff], leaves, allow_unused=True)) \
                    if diff and leaves else []
                results.append(([o.detach() for o in outs], grads))
            assert _equal(results[0][0], results[1][0]), f"{name}: outputs differ"
            assert _equal(results[0][1], results[1][1]), f"{name}: gradients differ"
            ran += 1
    assert ran > 0
    COUNTS["ops"].add(name)
    COUNTS["op samples"] += ran
