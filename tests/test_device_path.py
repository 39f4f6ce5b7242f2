"""The accelerator path, run on CPU tensors: a training loop with every rule on never reads a device value (on a GPU,
`bench/gpu.sh` runs the same loop under ``torch.cuda.set_sync_debug_mode("error")``)."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safetorch import _deferred

from .conftest import LIBRARIES, ROOT, findings

NOSYNC = os.path.join(ROOT, "bench", "nosync.py")


def _nosync(deferred: bool, steps: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    env.update({"SAFETORCH_REPORT": "0", "PYTHONPATH": os.pathsep.join([ROOT, LIBRARIES])})
    if deferred:
        env["SAFETORCH_DEFERRED_CPU"] = "1"
    proc = subprocess.run([sys.executable, "-m", "bench.nosync", "--steps", str(steps)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_loop_with_every_rule_on_never_reads_a_device_value_and_every_finding_is_at_its_line() -> None:
    # 1100 correct steps first: the first steps of the optimizer and a sample window (1024 backwards) are looked at.
    result = _nosync(deferred=True, steps=1100)
    assert result["deferred_cpu"] is True
    assert result["reads"] == []
    lines = {code: marked[0] for code, marked in result["lines"].items()}  # type: ignore[union-attr]
    with open(NOSYNC) as fh:  # ST013 is found in the forward that calls F.dropout, not where the module is called
        lines["ST013"] = next(i for i, ln in enumerate(fh, 1) if re.search(r"F\.dropout\(x, 0\.5\)\)  # ST013", ln))
    assert sorted(lines) == [f"ST{n:03d}" for n in range(1, 16)]
    assert sorted(map(tuple, result["findings"])) == sorted(lines.items())  # type: ignore[arg-type]


def test_the_recorder_sees_the_reads_of_the_cpu_path_inside_a_backward() -> None:
    # The control: without the accelerator path, ST006 reads each CPU loss with item() (there it costs nothing), and
    # the recorder sees it, although it runs inside torch.autograd.backward.
    result = _nosync(deferred=False, steps=20)
    assert result["deferred_cpu"] is False
    assert any(r.startswith("item at non_finite_loss.py") and "_before_backward" in r
               for r in result["reads"])  # type: ignore[union-attr]
    assert any(r.startswith("tolist at _deferred.py") for r in result["reads"])  # type: ignore[union-attr]


def _objects() -> tuple[int, int]:
    gc.collect()
    return len(gc.get_objects()), len(weakref.finalize._registry)  # type: ignore[attr-defined]


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu-path", "device-path"])
def test_nothing_safetorch_keeps_grows_over_20k_steps(deferred: bool) -> None:
    # 20k backwards cross 19 sample windows of ST010/ST011 (each left a finalizer, a watch and two tensors); on the
    # device path every backward also queues a check in the ring.
    _deferred.force_cpu(deferred)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    with findings() as got:
        steps(2_500)
        before = _objects()
        steps(17_500)
        after = _objects()
    assert got == []
    assert after[1] == before[1]
    assert after[0] - before[0] <= 20, (before, after)
