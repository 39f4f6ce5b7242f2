"""``python -m bench.calls [--loop LOOP] [--json PATH]``: which of safetorch's functions a step enters, and how often.

The instruction counts (`bench.instructions`) say how much a step pays; this says where: a profiler
(``sys.setprofile``) counts the calls of Python functions in safetorch's files during the loops of
`bench.instructions` (after the same warm-up), per step (per training + validation step pair for the MLPs, per
optimizer step for GPT-2), by function. A patched tensor method's replacement is ``call``; ST013's ``F.dropout`` is
``dropout``. Deterministic, and a few seconds: it runs anywhere, valgrind or not.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
from typing import Any

import torch

import safetorch

from . import models
from .endtoend import make_epoch, make_gpt2_epoch

LOOPS = ("tiny_mlp", "tiny_mlp_worst", "tiny_mlp_dropout_worst", "gpt2_layout")


def count(loop: str, steps: int | None = None) -> dict[str, Any]:
    """Calls entering safetorch during one epoch of ``loop`` after its warm-up, per step (pair)."""
    torch.manual_seed(0)
    if loop == "gpt2_layout":
        steps = steps or 4
        epoch = make_gpt2_epoch(models.GPT2(n_embd=96, vocab=1024), torch.randint(0, 1024, (1, 64)), steps)
        warmup, per = 4, steps  # past the optimizer's first 8 looked-at steps: the steady state
    else:
        steps = steps or 100
        model, x = models.tiny_mlp(0.1 if "dropout" in loop else 0.0), torch.randn(1, 16)
        epoch = make_epoch(model, x, torch.randint(0, 10, (1,)), steps, worst_case=loop.endswith("_worst"))
        warmup, per = 2, steps
    for _ in range(warmup):
        epoch()
    own = os.path.dirname(os.path.abspath(safetorch.__file__))
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(own):
                counts[f"{os.path.relpath(code.co_filename, own)}:{code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        epoch()
    finally:
        sys.setprofile(None)
    return {"loop": loop, "steps": per, "calls_per_step": round(sum(counts.values()) / per, 2),
            "by_function": {name: round(n / per, 2) for name, n in counts.most_common()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calls", description=__doc__.split("\n")[0])
    parser.add_argument("--loop", choices=LOOPS, action="append", help="the loop(s) to count (default: all)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    from . import __main__ as bench_main

    result = {"machine": bench_main.machine(), "date": datetime.date.today().isoformat(),
              "loops": [count(loop) for loop in args.loop or LOOPS]}
    for entry in result["loops"]:
        top = ", ".join(f"{name} {n:g}" for name, n in list(entry["by_function"].items())[:6])
        print(f"{entry['loop']}: {entry['calls_per_step']:g} calls into safetorch per step ({top})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
