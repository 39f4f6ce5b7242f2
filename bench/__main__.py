"""``python -m bench [--quick] [--json PATH]``: safetorch's overhead, as ratios from interleaved runs."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import warnings
from typing import Any

import torch
import wrapt

import safetorch
from safetorch._patch import wrapt_c_extension

from . import endtoend, memory, percall, startup


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "wrapt": wrapt.__version__,
        "wrapt_c_extension": wrapt_c_extension(),
    }


def _table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    out = [f"machine: {m['cpu']} | GPU: {m['gpu'] or 'none'} | torch {m['torch']} | Python {m['python']} | "
           f"wrapt {m['wrapt']} (C extension: {m['wrapt_c_extension']})", ""]
    out.append("Per call (ns, medians; ratio = median of round-by-round ratios):")
    out.append(_table([[k, f"{r['bare']['median']:.0f}", f"{r['safetorch']['median']:.0f}",
                        f"{r['wrapt']['median']:.0f}", f"{r['closure']['median']:.0f}", f"{r['ratio_vs_wrapt']:.2f}",
                        f"{r['closure_ratio_vs_bare']:.2f}"] for k, r in results["percall"].items()],
                      ["API", "bare", "safetorch", "wrapt pass-through", "closure", "safetorch/wrapt",
                       "closure/bare"]))
    out += ["", "End to end, training + validation step (µs, medians; overhead = median of per-round ratios):"]
    out.append(_table([[k, f"{r['without_us']['median']:.1f}", f"{r['with_us']['median']:.1f}",
                        f"{r['overhead_pct']:+.2f}%",
                        f"[{r['overhead_pct_iqr'][0]:+.2f}%, {r['overhead_pct_iqr'][1]:+.2f}%]"]
                       for k, r in results["endtoend"].items()],
                      ["loop", "without", "with", "overhead", "IQR"]))
    mem = results["memory"]
    out += ["", f"Memory ({mem['measure']}, {mem['model']}, batch {mem['batch']}, {mem['device']}):"]
    out.append(_table([["validation pass, no torch.no_grad()", str(mem["validation_without"]["bytes"]),
                        str(mem["validation_with"]["bytes"]), str(mem["validation_reduction"])],
                       ["training step", str(mem["training_without"]["bytes"]), str(mem["training_with"]["bytes"]),
                        "identical" if mem["training_identical"] else "DIFFERENT"]],
                      ["", "without (bytes)", "with (bytes)", "ratio"]))
    out += ["", f"Kept by a loop of {mem['kept_batches']} batches in training mode without no_grad, when it is over "
                "(bytes):"]
    out.append(_table([[shape, str(r["plain"]), str(r["safetorch"]), str(r["no_grad"])]
                       for shape, r in mem["kept"].items()], ["holder", "plain", "safetorch", "no_grad"]))
    st = results["startup"]
    out += ["", f"import safetorch after torch: {st['import_ms']['median']:.1f} ms "
                f"(with SAFETORCH_DISABLE=1: {st['import_ms_disabled']['median']:.1f} ms)",
            f"SAFETORCH_DISABLE=1: {st['disabled']['patched_attributes']} patched attributes, namespaces identical: "
            f"{st['disabled']['namespaces_identical']}"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run for CI (timings are rough)")
    parser.add_argument("--json", metavar="PATH", help="also write every sample as JSON")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # the memory bench forgets no_grad on purpose
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick,
                               "date": datetime.date.today().isoformat()}
    provoked: list[str] = []
    for name, part in (("percall", percall), ("endtoend", endtoend), ("memory", memory), ("startup", startup)):
        results[name] = part.run(args.quick)
        # What a part provokes on purpose (the memory bench's evaluation without no_grad, the per-call timing of
        # empty_cache) is the bench's own doing: kept in the results, not summarised at exit as a finding.
        provoked += [f"{f.code} {os.path.relpath(f.filename)}:{f.lineno}" for f in safetorch.findings()]
        safetorch.reset()
    results["provoked"] = provoked
    print(report(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
