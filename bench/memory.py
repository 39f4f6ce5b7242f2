"""Memory of a validation pass that forgot ``torch.no_grad()``, and of a training step, with and without safetorch.

On CPU torch keeps no peak-memory statistics, so the measure is the peak of the bytes of the tensors autograd saves
for backward that are alive at once (``saved_tensors_hooks``, released with their graph): exactly what a validation
loop without no_grad keeps alive and what runs a GPU out of memory. On CUDA it is ``torch.cuda.max_memory_allocated``
around the loop.

The validation loop is the usual one, ``out = model(x)`` per batch: without safetorch, the previous batch's graph is
still bound to ``out`` while the next forward builds its own, so two graphs are alive at the peak. With safetorch the
first forward at that line is watched (run as written, with its graph) and the next ones are checkpointed (their
activations are not kept): one graph at the peak, the first batch's, freed at the next batch.

The *kept* shapes are the loops ST004 reports (a validation loop in training mode without ``no_grad`` that keeps
every batch's loss): a Python number (``total += loss``), a tensor (``total = torch.zeros(()); total += loss``), a
list (``losses.append(loss)``), a dict (``outputs[i] = loss``). Measured: the bytes saved for backward still alive
when the loop is over, held by its accumulator or container — plain, with safetorch (which reports, and changes
nothing: the same bytes) and under ``no_grad`` (nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import safetorch
import safetorch.checks.eval_mode_grad

from . import models


class _Held:
    """A saved tensor, counted as alive until its graph lets go of it."""

    __slots__ = ("live", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, live: list[int]) -> None:
        # detached: a saved output holding its own grad_fn would make a cycle that only the GC frees
        self.tensor, self.live, self.nbytes = tensor.detach(), live, tensor.numel() * tensor.element_size()
        live[0] += self.nbytes
        live[1] = max(live[1], live[0])

    def __del__(self) -> None:
        self.live[0] -= self.nbytes


def saved_bytes(fn: Callable[[], Any]) -> int:
    """The peak of the bytes saved for backward that are alive at once while ``fn`` runs."""
    live = [0, 0]  # now, peak
    with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(t, live), lambda held: held.tensor):
        result = fn()
    del result
    return live[1]


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


BATCHES = 4


def _validation(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    def run() -> Any:
        correct = 0
        for _ in range(BATCHES):
            out = model(x)  # model.eval() was called; torch.no_grad() was forgotten
            correct += int((out.argmax(1) == 0).sum())
        return correct
    return run


def _training_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    criterion = torch.nn.CrossEntropyLoss()

    def run() -> Any:
        loss = criterion(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()
    return run


def kept_bytes(fn: Callable[[], Any]) -> int:
    """The bytes saved for backward that are still alive when ``fn`` has returned, while its result is held."""
    live = [0, 0]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(t, live), lambda held: held.tensor):
        result = fn()
    kept = live[0]
    del result
    return kept


def cuda_kept(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    del result
    return kept


KEPT_BATCHES = 8


def _kept_shapes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], Any]]:
    criterion = torch.nn.CrossEntropyLoss()

    def number() -> Any:
        total = 0.0
        for _ in range(KEPT_BATCHES):
            total += criterion(model(x), y)
        return total

    def tensor() -> Any:
        total = torch.zeros((), device=x.device)
        for _ in range(KEPT_BATCHES):
            total += criterion(model(x), y)
        return total

    def listed() -> Any:
        losses = []
        for _ in range(KEPT_BATCHES):
            losses.append(criterion(model(x), y))
        return losses

    def keyed() -> Any:
        outputs = {}
        for i in range(KEPT_BATCHES):
            outputs[i] = criterion(model(x), y)
        return outputs

    return {"number": number, "tensor": tensor, "list": listed, "dict": keyed}


def kept(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: str) -> dict[str, dict[str, int]]:
    """shape -> {"plain", "safetorch", "no_grad"}: the bytes the loop's holder keeps."""
    measure = cuda_kept if device == "cuda" else kept_bytes
    shapes = _kept_shapes(model, x, y)
    out: dict[str, dict[str, int]] = {name: {} for name in shapes}
    for state in ("plain", "safetorch", "no_grad"):
        (safetorch.install if state == "safetorch" else safetorch.uninstall)()
        for name, fn in shapes.items():
            with torch.no_grad() if state == "no_grad" else torch.enable_grad():
                out[name][state] = measure(fn)
    safetorch.install()
    return out


def run(quick: bool) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    measure = cuda_peak if device == "cuda" else saved_bytes
    torch.manual_seed(0)
    model = (models.resnet_like() if device == "cuda" else models.small_cnn()).to(device)
    batch = 64 if device == "cuda" else (8 if quick else 32)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    out: dict[str, Any] = {"device": device, "measure": measure.__name__, "batch": batch, "batches": BATCHES,
                           "model": "resnet_like" if device == "cuda" else "small_cnn"}
    model.train()
    train = _training_step(model, x, y)
    train()
    model.eval()
    val = _validation(model, x)
    results: dict[str, dict[str, int]] = {}
    for state in ("without", "with"):
        (safetorch.install if state == "with" else safetorch.uninstall)()
        safetorch.checks.eval_mode_grad.reset()  # a fresh call site: its first forward is watched
        model.eval()
        results[f"validation_{state}"] = {"bytes": measure(val)}
        model.train()
        results[f"training_{state}"] = {"bytes": measure(train)}
    safetorch.install()
    out.update(results)
    v_with, v_without = results["validation_with"]["bytes"], results["validation_without"]["bytes"]
    out["validation_reduction"] = round(v_without / v_with, 2) if v_with else "inf (nothing kept)"
    out["training_identical"] = results["training_with"] == results["training_without"]
    model.train()  # the loops ST004 reports: an evaluation in training mode without no_grad
    out["kept_batches"] = KEPT_BATCHES
    out["kept"] = kept(model, x, y, device)
    return out
