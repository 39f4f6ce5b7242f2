"""Memory of a validation pass that forgot ``torch.no_grad()``, and of a training step, with and without safetorch.

On CPU torch keeps no peak-memory statistics, so the measure is the peak of the bytes of the tensors autograd saves
for backward that are alive at once (``saved_tensors_hooks``, released with their graph): exactly what a validation
loop without no_grad keeps alive and what runs a GPU out of memory. On CUDA it is ``torch.cuda.max_memory_allocated``
around the loop.

The validation loop is the usual one, ``out = model(x)`` per batch: without safetorch, the previous batch's graph is
still bound to ``out`` while the next forward builds its own, so two graphs are alive at the peak. With safetorch the
first forward at that line is watched (run as written, with its graph) and the next ones keep what no_grad keeps:
one graph at the peak, the first batch's, freed at the next batch.

``python -m bench.memory --collected [--json PATH]``: the loop that collects its outputs for the metrics
(``outs.append(model(x))``, 50 batches of 512 through 4 x Linear(1024) + ReLU, a fresh input each), plain, under
safetorch and under ``no_grad``, each in a fresh interpreter: the heap bytes still in use after the loop (glibc's
``mallinfo2``: what the kept tensors and objects hold, without the allocator's free lists), the resident set and the
peak address space (``VmPeak``, what ``RLIMIT_AS`` limits), each less the same figures before the loop. Done when
safetorch keeps no more than no_grad plus one graph (``one_graph``: the bytes one forward as written saves).

The *kept* shapes are the loops ST004 reports (a validation loop in training mode without ``no_grad`` that keeps
every batch's loss): a Python number (``total += loss``), a tensor (``total = torch.zeros(()); total += loss``), a
list (``losses.append(loss)``), a dict (``outputs[i] = loss``). Measured: the bytes saved for backward still alive
when the loop is over, held by its accumulator or container — plain, with safetorch (which reports, and changes
nothing: the same bytes) and under ``no_grad`` (nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
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


_COLLECTED = """\
import ctypes, json, sys
MODE = sys.argv[1]
if MODE == "safetorch":
    import safetorch
import torch

class _Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                                               "keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = _Info

def now():
    info = libc.mallinfo2()
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    kb = lambda key: int(status[key].split()[0]) * 1024
    return {"heap_in_use": info.uordblks + info.hblkhd, "rss": kb("VmRSS"), "vm_peak": kb("VmPeak")}

torch.manual_seed(0)
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]).eval()
outs = []
before = now()
for _ in range(int(sys.argv[2])):
    x = torch.randn(int(sys.argv[3]), 1024)
    if MODE == "no_grad":
        with torch.no_grad():
            outs.append(model(x))
    else:
        outs.append(model(x))
after = now()
print(json.dumps({k: after[k] - before[k] for k in after}))
"""

MODES = ("plain", "safetorch", "no_grad")


def activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """The bytes one forward as written saves for backward beyond the parameters (which every mode keeps): one
    graph's activations, the forward's input included."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def collected(batches: int = 50, batch: int = 512, repeats: int = 3) -> dict[str, Any]:
    """Kept bytes of the collecting evaluation, per mode (see the module's docstring); glibc only. The heap bytes in
    use are the same in every repeat; the resident set and peak address space move with the allocator's choices
    (what it maps, what it keeps in free lists): each repeat's figure is given."""
    import os

    env = {"SAFETORCH_REPORT": "0", "PYTHONWARNINGS": "ignore", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}
    out: dict[str, Any] = {"batches": batches, "batch": batch, "model": "4 x Linear(1024) + ReLU", "repeats": repeats}
    for mode in MODES:
        runs = []
        for _ in range(repeats):
            proc = subprocess.run([sys.executable, "-c", _COLLECTED, mode, str(batches), str(batch)],
                                  capture_output=True, text=True, env=env, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-2000:])
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        out[mode] = {key: [r[key] for r in runs] for key in runs[0]}
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())])
    out["one_graph"] = activation_bytes(model, torch.randn(batch, 1024))
    out["outputs"] = batches * batch * 1024 * 4
    out["done"] = max(out["safetorch"]["heap_in_use"]) <= min(out["no_grad"]["heap_in_use"]) + out["one_graph"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--collected", action="store_true", help="the collecting evaluation, plain/safetorch/no_grad")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    from . import __main__ as bench_main

    result: dict[str, Any] = {"machine": bench_main.machine(), "date": datetime.date.today().isoformat()}
    if args.collected:
        result["collected"] = collected(*((5, 64, 1) if args.quick else ()))
        c = result["collected"]
        def mib(values: list[int]) -> str:
            return " / ".join(f"{v / 2**20:.1f}" for v in values)

        for mode in MODES:
            m = c[mode]
            print(f"{mode:>9} (MiB): heap in use {mib(m['heap_in_use'])}; RSS {mib(m['rss'])}; "
                  f"VmPeak {mib(m['vm_peak'])}")
        print(f"one graph: {c['one_graph'] / 2**20:.1f} MiB; outputs: {c['outputs'] / 2**20:.1f} MiB; "
              f"safetorch <= no_grad + one graph: {c['done']}")
    else:
        result["validation"] = run(quick=args.quick)
        print(json.dumps(result["validation"], indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
