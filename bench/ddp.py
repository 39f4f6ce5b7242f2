"""A 2-rank gloo DDP job's step time with safetorch on and off (ST016-ST018's cost where they run).

``python -m bench.ddp [--rounds R] [--steps N] [--quick] [--json PATH]``

Each round runs the same torchrun job twice, on (``import safetorch``) and off (``SAFETORCH_DISABLE=1``: imported,
nothing patched), in alternating order; a job trains a DDP-wrapped MLP for N steps (forward, backward, clipping,
step, ``zero_grad``) and rank 0 reports the mean time per step over all N after a warm-up, looked-at steps included
(the first 8, ST016's fingerprints among them). The figure is the median over rounds of each round's on/off ratio.
On a shared 2-core machine the two ranks compete with each other and with the machine's load: read the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

_JOB = textwrap.dedent("""\
    import json, os, sys, time
    import safetorch  # noqa: F401  (SAFETORCH_DISABLE=1 in the off run)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, steps = dist.get_rank(), int(sys.argv[1])
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(5):  # warm-up: not the looked-at steps, which are counted from each optimizer's first step
        with torch.no_grad():
            model(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"per_step_us": elapsed / steps * 1e6}))
    dist.destroy_process_group()
""")


def _job(path: str, steps: int, on: bool) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    env["OMP_NUM_THREADS"] = "1"
    if not on:
        env["SAFETORCH_DISABLE"] = "1"
    env["SAFETORCH_REPORT"] = "0"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", path, str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("{"))
    return float(json.loads(line)["per_step_us"])


def run(rounds: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ddp_job.py")
        with open(path, "w") as fh:
            fh.write(_JOB)
        samples = []
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {on: _job(path, steps, on) for on in order}
            samples.append({"on_us": got[True], "off_us": got[False], "ratio": got[True] / got[False]})
    ratios = [s["ratio"] for s in samples]
    return {"job": "2-rank gloo DDP, MLP 64-256-256-10, batch 32, AdamW, clip_grad_norm_", "steps": steps,
            "rounds": rounds, "samples": samples, "median_on_us": statistics.median(s["on_us"] for s in samples),
            "median_off_us": statistics.median(s["off_us"] for s in samples), "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="two rounds of 20 steps (a smoke run)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rounds, steps = (2, 20) if args.quick else (args.rounds, args.steps)
    result = run(rounds, steps)
    from . import __main__ as bench_main

    result["machine"] = bench_main.machine()
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    print(f"2-rank gloo DDP step: off {result['median_off_us']:.0f} us, on {result['median_on_us']:.0f} us, "
          f"on/off {result['median_ratio']:.3f} (rounds {result['min_ratio']:.3f}-{result['max_ratio']:.3f})")


if __name__ == "__main__":
    main()
