"""``python -m bench.act [--instructions] [--json PATH]``: what ST003's act costs an evaluation forward.

Once a call site is taken for an evaluation (an eval-mode model called with autograd on, for nothing), safetorch runs
its forwards under ``torch.no_grad()`` and grafts the output onto one autograd node that saves nothing
(`safetorch.checks._eval_act`): a backward that reaches one after all recomputes it and gets its gradients, where a
bare ``no_grad`` would fail or train on part of a gradient. This measures that choice, per validation forward of the
bench's models, three ways: as written (autograd on, every activation kept), as ST003 runs it (the act), and under
``torch.no_grad()`` (what the fixed program runs):

- time: the median of interleaved repeats of each way (the ratios, not the absolute figures, are the result);
- saved bytes: the peak of the tensors kept for backward, alive at once (``bench.memory.saved_bytes``);
- instructions (``--instructions``, needs valgrind): callgrind counts per forward, each way (20 forwards of the tiny
  MLP, 2 of the small CNN), one intra-op thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

WAYS = ("as_written", "act", "no_grad")


def _model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    from . import models

    torch.manual_seed(0)
    if name == "small_cnn":
        return models.small_cnn().eval(), torch.randn(32, 3, 32, 32)
    return models.tiny_mlp().eval(), torch.randn(1, 16)


def forward(way: str, model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    """One validation forward, the given way (safetorch's act called as ST003 calls it, at a decided site)."""
    from safetorch.checks import eval_mode_grad

    call = torch.nn.Module._call_impl
    if way == "no_grad":
        def run() -> Any:
            with torch.no_grad():
                return call(model, x)
    elif way == "act":
        site = eval_mode_grad._Site(model, sys._getframe())
        site.state = eval_mode_grad._Site.EVAL
        eval_mode_grad._evaluation(site, None)

        def run() -> Any:
            return eval_mode_grad._act(model, site, (x,), {})
    else:
        def run() -> Any:
            return call(model, x)
    return run


def timed(name: str, repeats: int = 15, number: int = 20) -> dict[str, float]:
    model, x = _model(name)
    runs = {way: forward(way, model, x) for way in WAYS}
    for run in runs.values():
        run()
    samples: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(repeats):
        for way, run in runs.items():  # interleaved: a slow moment of the machine hits every way
            start = time.perf_counter()
            for _ in range(number):
                run()
            samples[way].append((time.perf_counter() - start) / number)
    return {way: statistics.median(s) * 1e6 for way, s in samples.items()}


def saved(name: str) -> dict[str, int]:
    from .memory import saved_bytes

    model, x = _model(name)
    return {way: saved_bytes(forward(way, model, x)) for way in WAYS}


_PROGRAM = """\
import functools, sys, torch
torch.set_num_threads(1)
from bench.act import _model, forward
model, x = _model(sys.argv[1])
run = forward(sys.argv[2], model, x)
run(); run()
functools.reduce(lambda acc, _: run(), range(int(sys.argv[3])), None)
"""

FORWARDS = {"tiny_mlp": 20, "small_cnn": 2}


def instructions(name: str) -> dict[str, int]:
    counts = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}
    for way in WAYS:
        proc = subprocess.run(["valgrind", "--tool=callgrind", "--toggle-collect=functools_reduce",
                               "--callgrind-out-file=/dev/null", sys.executable, "-c", _PROGRAM, name, way,
                               str(FORWARDS[name])],
                              capture_output=True, text=True, env=env)
        match = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
        if proc.returncode != 0 or match is None:
            raise RuntimeError(proc.stderr[-2000:])
        counts[way] = round(int(match.group(1).replace(",", "")) / FORWARDS[name])
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.act", description=__doc__.split("\n")[0])
    parser.add_argument("--instructions", action="store_true", help="also count instructions (needs valgrind)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    from . import __main__ as bench_main

    result: dict[str, Any] = {"machine": bench_main.machine(), "date": datetime.date.today().isoformat(),
                              "torch": torch.__version__}
    for name in ("tiny_mlp", "small_cnn"):
        entry: dict[str, Any] = {"microseconds": timed(name), "saved_bytes": saved(name)}
        if args.instructions and shutil.which("valgrind"):
            entry["instructions"] = instructions(name)
        us = entry["microseconds"]
        entry["act_over_no_grad"] = round(us["act"] / us["no_grad"], 2)
        entry["act_over_as_written"] = round(us["act"] / us["as_written"], 2)
        result[name] = entry
        print(f"{name}: per forward {us['as_written']:.1f} µs as written, {us['act']:.1f} as ST003's act, "
              f"{us['no_grad']:.1f} under no_grad; saved bytes {entry['saved_bytes']}"
              + (f"; instructions {entry['instructions']}" if "instructions" in entry else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
