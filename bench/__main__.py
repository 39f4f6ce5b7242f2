"""``python -m bench [--quick] [--json PATH]``: safetorch's overhead, as ratios from interleaved runs."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

import torch
import wrapt

from . import percall


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
        "wrapt_c_extension": type(wrapt.FunctionWrapper).__module__ == "builtins"
        or wrapt.FunctionWrapper.__module__ == "builtins",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run for CI (timings are rough)")
    parser.add_argument("--json", metavar="PATH", help="also write every sample as JSON")
    args = parser.parse_args(argv)
    results = {"machine": machine(), "quick": args.quick, "percall": percall.run(args.quick)}
    print(f"machine: {results['machine']}")
    print()
    print("| API | bare ns | safetorch ns | wrapt pass-through ns | closure ns | safetorch / wrapt |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in results["percall"].items():
        print(f"| {label} | {r['bare']['median']:.0f} | {r['safetorch']['median']:.0f} | {r['wrapt']['median']:.0f} "
              f"| {r['closure']['median']:.0f} | {r['ratio_vs_wrapt']:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
