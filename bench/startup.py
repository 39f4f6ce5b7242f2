"""Import time of ``import safetorch`` after torch, and proof that ``SAFETORCH_DISABLE=1`` patches nothing.

Each measurement is a fresh interpreter (an import is cached once done); the two states alternate.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPORT_TIME = """
import time, torch
t0 = time.perf_counter()
import safetorch
print((time.perf_counter() - t0) * 1e3)
"""

DISABLED = """
import json, sys, time, torch, torch.nn.functional as F
from torch.nn import _reduction
spaces = [torch.Tensor, torch.nn.Module, torch.autograd, torch.cuda, F, _reduction, sys]
before = [dict(vars(s)) for s in spaces]
import safetorch
from safetorch._patch import registry
same = all(dict(vars(s)).keys() == b.keys() and all(vars(s)[k] is b[k] for k in b) for s, b in zip(spaces, before))
print(json.dumps({"patched_attributes": len(registry.touched()), "namespaces_identical": same,
                  "checks": safetorch.installed_checks()}))
"""


def _python(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    full["PYTHONPATH"] = ROOT + os.pathsep + full.get("PYTHONPATH", "")
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, check=True)
    return out.stdout.strip().splitlines()[-1]


def run(quick: bool) -> dict[str, Any]:
    rounds = 3 if quick else 10
    enabled: list[float] = []
    disabled: list[float] = []
    for _ in range(rounds):
        enabled.append(float(_python(IMPORT_TIME)))
        disabled.append(float(_python(IMPORT_TIME, SAFETORCH_DISABLE="1")))
    return {
        "import_ms": {"samples": [round(v, 2) for v in enabled], "median": round(statistics.median(enabled), 2)},
        "import_ms_disabled": {"samples": [round(v, 2) for v in disabled],
                               "median": round(statistics.median(disabled), 2)},
        "disabled": json.loads(_python(DISABLED, SAFETORCH_DISABLE="1")),
    }
