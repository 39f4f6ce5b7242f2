"""Memory of a validation pass that forgot ``torch.no_grad()``, and of a training step, with and without safetorch.

On CPU torch keeps no peak-memory statistics, so the measure is the bytes of the tensors autograd saves for
backward during the forward (``saved_tensors_hooks``): exactly what a validation loop without no_grad keeps alive
and what runs a GPU out of memory. On CUDA it is ``torch.cuda.max_memory_allocated`` around the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import safetorch

from . import models


def saved_bytes(fn: Callable[[], Any]) -> int:
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def cuda_peak(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def _validation(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    def run() -> Any:
        return model(x)  # model.eval() was called; torch.no_grad() was forgotten
    return run


def _training_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    criterion = torch.nn.CrossEntropyLoss()

    def run() -> Any:
        loss = criterion(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()
    return run


def run(quick: bool) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    measure = cuda_peak if device == "cuda" else saved_bytes
    torch.manual_seed(0)
    model = (models.resnet_like() if device == "cuda" else models.small_cnn()).to(device)
    batch = 64 if device == "cuda" else (8 if quick else 32)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    out: dict[str, Any] = {"device": device, "measure": measure.__name__, "batch": batch,
                           "model": "resnet_like" if device == "cuda" else "small_cnn"}
    model.train()
    train = _training_step(model, x, y)
    train()
    model.eval()
    val = _validation(model, x)
    results: dict[str, dict[str, int]] = {}
    for state in ("without", "with"):
        (safetorch.install if state == "with" else safetorch.uninstall)()
        model.eval()
        results[f"validation_{state}"] = {"bytes": measure(val)}
        model.train()
        results[f"training_{state}"] = {"bytes": measure(train)}
    safetorch.install()
    out.update(results)
    v_with, v_without = results["validation_with"]["bytes"], results["validation_without"]["bytes"]
    out["validation_reduction"] = round(v_without / v_with, 2) if v_with else "inf (nothing kept)"
    out["training_identical"] = results["training_with"] == results["training_without"]
    return out
