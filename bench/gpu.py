"""``python -m bench.gpu --out DIR [--dry-run]``: the GPU figures of the headline, as JSON under DIR.

- ``gpu-steps.json``: step time with safetorch on vs ``SAFETORCH_DISABLE=1``, for GPT-2 small (124M; batch 8, seq
  1024, AdamW, bf16 autocast, clip) and ResNet-50 (batch 256, 224x224, SGD, fp16 autocast with a GradScaler). Each
  measure is a process of its own (warm-up, then per-step CUDA events), the two states alternating over rounds; the
  figure is the median of the round-by-round ratios of median step times.
- ``gpu-memory.json``: the seed's validation loop (``model.eval()`` without ``torch.no_grad()``): its peak memory
  (``torch.cuda.max_memory_allocated``) with and without safetorch (`bench.memory`).

``--dry-run`` runs the same code on the CPU at tiny sizes (one round, two steps): the test suite runs it, so that the
script a GPU run depends on cannot rot. ``python -m bench.gpu --step MODEL`` is one measuring process (internal).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpt2(device: str, tiny: bool) -> tuple[Any, Any]:
    from . import models

    model = (models.GPT2(n_layer=2, n_embd=48, n_head=4, vocab=256, ctx=64) if tiny else models.GPT2()).to(device)
    batch, seq = (2, 32) if tiny else (8, 1024)
    vocab = model.wte.num_embeddings
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    targets = idx.roll(-1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    dtype = torch.bfloat16

    def step() -> None:
        with torch.autocast(device_type=device, dtype=dtype):
            logits = model(idx)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def _resnet50(device: str, tiny: bool) -> tuple[Any, Any]:
    from . import models

    model = (models.resnet50(classes=10, width=8) if tiny else models.resnet50()).to(device)
    batch, size = (2, 32) if tiny else (256, 224)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler(device)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16

    def step() -> None:
        with torch.autocast(device_type=device, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return model, step


MODELS = {"gpt2_small": _gpt2, "resnet50": _resnet50}
LABELS = {"gpt2_small": "GPT-2 small (124M; batch 8, seq 1024, AdamW, bf16 autocast, clip)",
          "resnet50": "ResNet-50 (batch 256, 224x224, SGD, fp16 autocast + GradScaler)"}


def _measure_step(name: str, steps: int, warmup: int, device: str, tiny: bool) -> dict[str, Any]:
    """In this process (safetorch on or off by the environment): ms per step."""
    import safetorch  # noqa: F401  (installs the checks unless SAFETORCH_DISABLE=1)

    torch.manual_seed(0)
    model, step = MODELS[name](device, tiny)
    model.train()
    for _ in range(warmup):
        step()
    times = []
    if device == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "ms": times,
            "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}


def _one(name: str, on: bool, steps: int, warmup: int, device: str, tiny: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    env["SAFETORCH_REPORT"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    if not on:
        env["SAFETORCH_DISABLE"] = "1"
    cmd = [sys.executable, "-m", "bench.gpu", "--step", name, "--steps", str(steps), "--warmup", str(warmup),
           "--device", device] + (["--tiny"] if tiny else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_ROOT, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def steps_ratio(name: str, rounds: int, steps: int, warmup: int, device: str, tiny: bool) -> dict[str, Any]:
    per: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(rounds):
        for state in (("with", "without") if r % 2 else ("without", "with")):
            per[state].append(_one(name, state == "with", steps, warmup, device, tiny)["median_ms"])
    ratios = [w / o for w, o in zip(per["with"], per["without"], strict=True)]
    return {"model": LABELS[name] + (" [tiny, dry run]" if tiny else ""), "device": device, "rounds": rounds,
            "steps_per_round": steps, "warmup": warmup, "median_step_ms": {k: statistics.median(v) for k, v in
                                                                            per.items()},
            "rounds_ms": per, "ratio": round(statistics.median(ratios), 4),
            "overhead_pct": round((statistics.median(ratios) - 1) * 100, 2)}


def machine() -> dict[str, Any]:
    from . import __main__ as bench_main

    return {**bench_main.machine(), "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step", choices=sorted(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        print(json.dumps(_measure_step(args.step, args.steps, args.warmup, args.device, args.tiny)))
        return 0
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a machine without one", file=sys.stderr)
        return 2
    rounds, steps, warmup = (1, 2, 1) if args.dry_run else (args.rounds, 20, 5)
    os.makedirs(args.out, exist_ok=True)
    status = 0
    results: dict[str, Any] = {"machine": machine(), "dry_run": args.dry_run, "steps": {}}
    for name in MODELS:
        try:
            results["steps"][name] = steps_ratio(name, rounds, steps, warmup, device, args.dry_run)
        except Exception as exc:  # one model's failure leaves the other's figures
            results["steps"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            status = 1
        with open(os.path.join(args.out, "gpu-steps.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    from . import memory

    try:
        peak = {"machine": results["machine"], "dry_run": args.dry_run, **memory.run(quick=args.dry_run)}
    except Exception as exc:
        peak, status = {"error": f"{type(exc).__name__}: {exc}"}, 1
    with open(os.path.join(args.out, "gpu-memory.json"), "w") as fh:
        json.dump(peak, fh, indent=1)
    for name, r in results["steps"].items():
        print(f"{name}: " + (r["error"] if "error" in r else
                             f"{r['median_step_ms']['without']:.2f} ms -> {r['median_step_ms']['with']:.2f} ms per "
                             f"step, {r['overhead_pct']:+.2f}% (median of {r['rounds']} rounds)"))
    print("validation peak memory: " + (peak["error"] if "error" in peak else
                                       f"{peak['validation_without']['bytes']} bytes without safetorch, "
                                       f"{peak['validation_with']['bytes']} with it"))
    return status


if __name__ == "__main__":
    sys.exit(main())
