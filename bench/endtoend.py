"""A training + validation step with safetorch installed vs. uninstalled, toggled between interleaved rounds.

The loop is *correct* code (``model.train()``, training steps, ``model.eval()``, validation steps under
``torch.no_grad()``): what is measured is what safetorch costs a program that has nothing to report. Each round
runs such an epoch with safetorch on and one with it off, in an order that alternates; the overhead is the median
of the round-by-round ratios, with its spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import safetorch

from . import models
from ._timing import summary


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_epoch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
               frozen_bn: bool = False, worst_case: bool = False) -> Callable[[], float]:
    """A miniature epoch: ``steps`` training steps, then ``steps`` validation steps under no_grad, as a real loop.

    ``frozen_bn``: after ``model.train()`` every BatchNorm is put in eval mode by the program (fine-tuning with
    frozen statistics), which gives ST003 one ``eval()`` call per BatchNorm per epoch to follow.

    ``worst_case``: every training step also converts its batch three times (``.to(dtype)``, ``.to(device)``,
    ``.float()``: the calls ST001 looks at), and every 16 steps the model goes to ``eval()`` for one validation
    batch under ``no_grad`` and back to ``train()`` (what ST003 and ST008 follow)."""
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def epoch() -> float:
        model.train()
        if frozen_bn:
            models.freeze_batchnorm(model)
        for i in range(steps):
            if worst_case:
                if i % 16 == 15:
                    model.eval()
                    with torch.no_grad():
                        criterion(model(x), y)
                    model.train()
                batch = x.to(torch.float32)
                batch = batch.to(x.device)
                batch = batch.float()
                loss = criterion(model(batch), y)
            else:
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        total = 0.0
        with torch.no_grad():
            for _ in range(steps):
                total += criterion(model(x), y).item()
        return total  # what a loop logs; .item() is also the natural sync point

    return epoch


_LONG_EPOCH = """\
def make(model, x, y, steps, criterion, optimizer):
    def epoch():
        model.train()
        if steps < 0:  # never taken: {pad} lines that make the training function {lines} lines long
{padding}
        for i in range(steps):
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        total = 0.0
        with torch.no_grad():
            for _ in range(steps):
                total += criterion(model(x), y).item()
        return total
    return epoch
"""


def make_long_epoch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
                    lines: int) -> Callable[[], float]:
    """`make_epoch`'s plain loop in a training function ``lines`` lines long (at least 16), written to a file so that
    its source can be read, as a program's can: what costs per line of the program's function shows."""
    import os
    import tempfile

    pad = max(lines - 16, 0)
    padding = "\n".join(f"            pad_{i} = i * {i}" for i in range(pad)) or "            pass"
    source = _LONG_EPOCH.format(pad=pad, lines=lines, padding=padding)
    path = os.path.join(tempfile.gettempdir(), f"safetorch_bench_epoch_{lines}.py")
    with open(path, "w") as fh:
        fh.write(source)
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(source, path, "exec"), namespace)
    return namespace["make"](model, x, y, steps, torch.nn.CrossEntropyLoss(),  # type: ignore[no-any-return]
                             torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))


def make_gpt2_epoch(model: torch.nn.Module, idx: torch.Tensor, steps: int,
                    accumulation: int = 2) -> Callable[[], float]:
    """GPT-2's training step as nanoGPT writes it: ``accumulation`` micro-batches, each loss divided by their number,
    gradient clipping at 1.0, AdamW, ``zero_grad(set_to_none=True)``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    targets = idx.roll(-1, dims=1)

    def epoch() -> float:
        model.train()
        for _ in range(steps):
            for _ in range(accumulation):
                logits = model(idx)
                loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
                (loss / accumulation).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return 0.0

    return epoch


def measure(epoch: Callable[[], Any], device: str, steps: int, rounds: int, warmup: int,
            on: Callable[[], None] = safetorch.install) -> dict[str, Any]:
    """µs per step (one training or one validation step), with (``on``) and without safetorch, rounds interleaved."""
    for _ in range(warmup):
        epoch()
    per: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(rounds):
        order = ("with", "without") if r % 2 else ("without", "with")
        for state in order:
            (on if state == "with" else safetorch.uninstall)()
            epoch()  # the first epoch after a toggle re-binds caches
            _sync(device)
            t0 = time.perf_counter()
            epoch()
            _sync(device)
            per[state].append((time.perf_counter() - t0) / (2 * steps) * 1e6)
    safetorch.install()
    ratios = [w / o for w, o in zip(per["with"], per["without"], strict=True)]
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {
        "without_us": summary(per["without"]),
        "with_us": summary(per["with"]),
        "ratio": round(statistics.median(ratios), 4),
        "overhead_pct": round((statistics.median(ratios) - 1) * 100, 2),
        "overhead_pct_iqr": [round((q[0] - 1) * 100, 2), round((q[2] - 1) * 100, 2)],
        "steps_per_sample": 2 * steps,
        "rounds": rounds,
    }


def run(quick: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    rounds = 6 if quick else 40
    # Short epochs, many rounds: on a shared machine the noise comes in bursts, and a ratio taken from two epochs run
    # next to each other is less likely to straddle one.
    cpu = {
        "cpu small CNN (batch 8, 32x32)": (models.small_cnn(), torch.randn(8, 3, 32, 32), 10, 5 if quick else 10,
                                           6 if quick else 80),
        "cpu tiny MLP (batch 1)": (models.tiny_mlp(), torch.randn(1, 16), 10, 50 if quick else 100,
                                   6 if quick else 160),
    }
    for label, (model, x, classes, steps, cpu_rounds) in cpu.items():
        y = torch.randint(0, classes, (x.shape[0],))
        out[label] = measure(make_epoch(model, x, y, steps), "cpu", steps, cpu_rounds, warmup=1)
    # The worst case for the per-call checks: three conversions per step, train/eval every 16 steps.
    model, x = models.tiny_mlp(), torch.randn(1, 16)
    steps, cpu_rounds = (50, 6) if quick else (100, 160)
    out["cpu tiny MLP worst case (batch 1, 3 conversions/step, eval every 16)"] = measure(
        make_epoch(model, x, torch.randint(0, 10, (1,)), steps, worst_case=True), "cpu", steps, cpu_rounds, warmup=1)
    x = torch.randn(4, 3, 32, 32)
    steps = 3 if quick else 5
    out["cpu ResNet-18-like, frozen BatchNorm (batch 4, 32x32)"] = measure(
        make_epoch(models.resnet18_like(), x, torch.randint(0, 10, (4,)), steps, frozen_bn=True), "cpu", steps,
        6 if quick else 40, warmup=1)
    if torch.cuda.is_available():
        gpu = {
            "cuda ResNet-like (batch 64, 32x32)": (models.resnet_like(), torch.randn(64, 3, 32, 32)),
            "cuda small transformer (batch 64, seq 64)": (models.small_transformer(), torch.randn(64, 64, 256)),
        }
        steps = 10 if quick else 50
        for label, (model, x) in gpu.items():
            model, x = model.cuda(), x.cuda()
            model(x)  # materialise lazy layers
            y = torch.randint(0, 10, (x.shape[0],), device="cuda")
            out[label] = measure(make_epoch(model, x, y, steps), "cuda", steps, rounds, warmup=2)
        # ST006 alone on a GPU step: its device-side check, with no host synchronisation.
        model, x = models.resnet_like().cuda(), torch.randn(64, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (64,), device="cuda")
        others = [code for code in safetorch.RULES if code != "ST006"]
        out["cuda ResNet-like, ST006 alone"] = measure(make_epoch(model, x, y, steps), "cuda", steps, rounds,
                                                       warmup=2, on=lambda: safetorch.install(ignore=others))
        safetorch.install(ignore=())
    return out
