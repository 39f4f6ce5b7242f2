"""A loop's cost in instructions.

``python -m bench.instructions [--loop LOOP] [--steps N] [--seeds K] [--lines N] [--device-path] [--json PATH]``

LOOP: tiny_mlp (the default), tiny_mlp_worst, tiny_mlp_dropout_worst, small_cnn, frozen_bn, gpt2_layout or
gpt2_small (one training step per count: 124M parameters, minutes under callgrind). ``--lines N`` pads the tiny MLP's
training function to N lines; ``--device-path`` makes CPU tensors take the accelerator path in both runs
(``SAFETORCH_DEFERRED_CPU=1``: the lines a GPU run executes, counted on the CPU).

Timings on a shared machine move by several percent between runs, whatever the repeats; the number of instructions
the CPU executes does not. This runs the end-to-end tiny-MLP epoch (`bench.endtoend.make_epoch`: training steps,
then validation steps under ``no_grad``) under valgrind's callgrind twice: with safetorch installed, and with
``SAFETORCH_DISABLE=1`` (imported, nothing patched: what a program that never imports it runs), counting only inside
the measured epochs (everything else — interpreter start, ``import torch``, warm-up — is left out by
``--toggle-collect``, and a ``gc.collect()`` before them starts both runs with the same empty young generation).
Optional: it needs valgrind, and takes a few minutes per seed.

Counts are not noise-free either: string hashes (``PYTHONHASHSEED``) move dict probing and memory layout, which
moved the tiny MLP's count by about ±2.5k instructions per step pair between seeds; so does the size of the
environment (40 bytes more moved the run with safetorch by 3k per step pair, the same hash seed), and so does any
change to the code that moves what is allocated where (a docstring two lines shorter moved the tiny MLP's figure
from +1.24% to +0.97%). Each seed's pair of runs uses one hash seed, one environment size and one heap layout
(``k * HEAP_OBJECTS`` small objects allocated before ``import torch`` for seed ``k``), the same in both runs
(which differ only in ``SAFETORCH_DISABLE=0`` or ``1``), and the figure is the sum over ``--seeds`` seeds (0, 1,
…). A difference of a few tenths of a point between two commits is within what layout alone moves; a change is
judged first by its count per call in a loop of its own (bench/README's per-call table), or by both versions in one
process and one layout, then here.

Installing and then uninstalling safetorch in the same process is no baseline: torch's bytecode, specialised while
the patches stood, stays slower by about 2.5k instructions per step pair (measured), which would flatter safetorch.

Instructions are not time: the same count can take longer when it misses the caches more, which Python code does
more than torch's kernels. The timed bench (`python -m bench`) stays the measure; this is its noise-free companion.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from typing import Any

_PROGRAM = textwrap.dedent("""\
    import functools, gc, os
    # Each seed's heap layout: small objects allocated before anything else, the same in both runs (kept alive).
    _heap = [bytes(8 * (i % 16 + 1)) for i in range(int(os.environ["BENCH_HEAP"]))]
    import torch, safetorch
    from bench import models
    from bench.endtoend import make_epoch, make_gpt2_epoch, make_long_epoch
    torch.manual_seed(0)
    loop, steps, lines = os.environ["BENCH_LOOP"], int(os.environ["BENCH_STEPS"]), int(os.environ["BENCH_LINES"])
    epochs, warmup = 2, 2
    if loop.startswith("gpt2"):
        small = loop == "gpt2_small"
        model = models.GPT2() if small else models.GPT2(n_embd=96, vocab=1024)
        epoch, epochs = make_gpt2_epoch(model, torch.randint(0, 1024, (1, 64)), steps), 1
        warmup = int(os.environ["BENCH_WARMUP"])
    elif lines:
        model, x = models.tiny_mlp(), torch.randn(1, 16)
        epoch = make_long_epoch(model, x, torch.randint(0, 10, (1,)), steps, lines)
    else:
        if loop == "frozen_bn":
            model, x = models.resnet18_like(), torch.randn(4, 3, 32, 32)
        elif loop == "small_cnn":
            model, x = models.small_cnn(), torch.randn(8, 3, 32, 32)
        else:
            model, x = models.tiny_mlp(0.1 if "dropout" in loop else 0.0), torch.randn(1, 16)
        epoch = make_epoch(model, x, torch.randint(0, 10, (x.shape[0],)), steps, frozen_bn=loop == "frozen_bn",
                           worst_case=loop.endswith("_worst"))
    for _ in range(warmup):
        epoch()                                                   # warm-up: not counted
    gc.collect()
    functools.reduce(lambda acc, _: epoch(), range(epochs), None)  # counted: what runs inside functools.reduce
""")


LOOPS = {"tiny_mlp": "cpu tiny MLP (batch 1)",
         "gpt2_small": "cpu GPT-2 small (124M: 12 layers, 768 wide; batch 1, seq 64, 2 micro-batches, clip, AdamW)",
         "gpt2_layout": "cpu GPT-2 small's layout at width 96 (12 layers, 12 heads, vocab 1024; batch 1, seq 64, "
                        "2 micro-batches, clip, AdamW)",
         "tiny_mlp_worst": "cpu tiny MLP worst case (batch 1, 3 conversions/step, eval every 16)",
         "tiny_mlp_dropout_worst": "cpu tiny MLP with dropout, worst case (batch 1, 3 conversions/step, eval every "
                                   "16; a model ST019 follows)",
         "small_cnn": "cpu small CNN (batch 8, 32x32)",
         "frozen_bn": "cpu ResNet-18-like, frozen BatchNorm (batch 4, 32x32)"}


#: Small objects the counted program allocates before ``import torch``, per seed: seed ``k`` allocates ``k`` times this.
HEAP_OBJECTS = 1000


def _warmup(loop: str, steps: int, window: bool) -> int:
    """Warm-up epochs before the counted one. The GPT-2 loops count one epoch of ``steps`` optimizer steps: past the
    optimizer's first looked-at steps (`safetorch._steps.FIRST`, and the backward after them, where a look's listener
    acts), which is every later step of a run but 2 in 1024 backwards (the steady state); or, ``window``, the
    optimizer's steps ``steps + 1`` to ``2 * steps``, which are looked-at steps (steps 5 to 8 by default)."""
    if not loop.startswith("gpt2"):
        return 2
    from safetorch._steps import FIRST

    return 1 if window else -(-FIRST // steps) + 1


def _launch(on: bool, steps: int, loop: str, seed: int, lines: int = 0,
            device_path: bool = False, window: bool = False) -> subprocess.Popen[str]:
    # One intra-op thread: callgrind counts every thread, and OpenMP workers spin while they wait, a count that
    # depends on timing (the conv net's counts moved by a third between two runs with the default threads).
    env = {**os.environ, "BENCH_STEPS": str(steps), "BENCH_LOOP": loop, "PYTHONHASHSEED": str(seed),
           "BENCH_LINES": str(lines), "BENCH_WARMUP": str(_warmup(loop, steps, window)),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("SAFETORCH_IGNORE", None)
    env.pop("SAFETORCH_DEFERRED_CPU", None)
    if device_path:
        env["SAFETORCH_DEFERRED_CPU"] = "1"  # CPU tensors take the accelerator path (safetorch._deferred)
    # Both runs get the same variables, of the same lengths: the environment's size alone moves the count (the same
    # program, the same hash seed, 40 bytes more of environment: 3k instructions per step pair more, measured).
    env["SAFETORCH_DISABLE"] = "0" if on else "1"
    # And each seed its own environment size, the same for both of its runs: a figure summed over seeds is then
    # summed over layouts too, not over one layout that may favour either run.
    env["BENCH_LAYOUT"] = "x" * (37 * seed)
    # And its own heap layout (measured at one hash seed, 0 to 5,000 objects: the tiny MLP's overhead ranged from
    # +0.95% to +1.30%, where hash seeds and environment lengths had moved it by about a tenth of a point).
    env["BENCH_HEAP"] = str(HEAP_OBJECTS * seed)
    cmd = ["valgrind", "--tool=callgrind", "--toggle-collect=functools_reduce", "--callgrind-out-file=/dev/null",
           sys.executable, "-c", _PROGRAM]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collected(proc: subprocess.Popen[str]) -> int:
    out, err = proc.communicate()
    match = re.search(r"I\s+refs:\s+([\d,]+)", err)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f"valgrind run failed ({proc.returncode}):\n{err[-2000:]}")
    return int(match.group(1).replace(",", ""))


def run(steps: int, loop: str = "tiny_mlp", seeds: int = 3, lines: int = 0,
        device_path: bool = False, window: bool = False) -> dict[str, Any]:
    """For each hash seed, both runs side by side (one per core); counts per training + validation step pair (per
    training step for the GPT-2 loops, one counted epoch)."""
    per_seed = []
    for seed in range(seeds):
        procs = {"without": _launch(False, steps, loop, seed, lines, device_path, window),
                 "with": _launch(True, steps, loop, seed, lines, device_path, window)}
        per_seed.append({k: _collected(p) for k, p in procs.items()})
    counts = {k: sum(c[k] for c in per_seed) for k in ("without", "with")}
    # per seed: two counted epochs of `steps` training and `steps` validation steps; GPT-2: one epoch of `steps`
    pairs = (steps if loop.startswith("gpt2") else 2 * steps) * seeds
    label = LOOPS[loop] + (f", a {lines}-line training function" if lines else "")
    if loop.startswith("gpt2"):
        first = _warmup(loop, steps, window) * steps + 1
        label += f", optimizer steps {first}-{first + steps - 1} ({'looked-at steps' if window else 'steady state'})"
    return {
        "loop": label + (", accelerator path forced on CPU tensors" if device_path else ""),
        "device_path": device_path,
        "looked_at_window": window,
        "training_function_lines": lines or None,
        "steps_per_epoch": steps,
        "hash_seeds": seeds,
        "instructions": counts,
        "per_step_pair": {k: round(v / pairs) for k, v in counts.items()},
        "safetorch_per_step_pair": round((counts["with"] - counts["without"]) / pairs),
        "overhead_pct": round((counts["with"] / counts["without"] - 1) * 100, 2),
        "overhead_pct_per_seed": [round((c["with"] / c["without"] - 1) * 100, 2) for c in per_seed],
    }


_DEFAULT_STEPS = {"frozen_bn": 5, "small_cnn": 10, "gpt2_small": 1, "gpt2_layout": 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="training (and validation) steps per epoch "
                             "(default: 100 for the MLPs, 10 for small_cnn, 5 for frozen_bn)")
    parser.add_argument("--loop", choices=sorted(LOOPS), default="tiny_mlp", help="which loop to count")
    parser.add_argument("--seeds", type=int, default=3, help="hash seeds to sum over, one pair of runs each")
    parser.add_argument("--lines", type=int, default=0,
                        help="tiny MLP only: the training function padded to this many lines (source on disk)")
    parser.add_argument("--device-path", action="store_true",
                        help="CPU tensors take the accelerator path (what a GPU run executes), in both runs")
    parser.add_argument("--window", action="store_true",
                        help="GPT-2 loops: count the optimizer's looked-at steps 5-8 (what the first steps of a run, "
                             "and 2 in every 1024 backwards after them, cost) instead of the steady state")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing measured", file=sys.stderr)
        return 2
    from . import __main__ as bench_main

    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    result = {"machine": bench_main.machine(), "valgrind": version, "date": datetime.date.today().isoformat(),
              **run(args.steps or _DEFAULT_STEPS.get(args.loop, 100), args.loop, args.seeds, args.lines,
                    args.device_path, args.window)}
    print(f"{result['loop']}: {result['per_step_pair']['without']} instructions per step (pair) "
          f"without safetorch, {result['per_step_pair']['with']} with it "
          f"(+{result['safetorch_per_step_pair']}): {result['overhead_pct']:+.2f}% "
          f"(per hash seed: {', '.join(f'{p:+.2f}%' for p in result['overhead_pct_per_seed'])})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
