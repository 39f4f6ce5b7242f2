"""ST016-ST018 (and ST010/ST011 in DDP loops) in 2-rank gloo jobs on the CPU, run as users run them: torchrun and
``mp.spawn``, with safetorch and without it. The job is tests/distributed_job.py: each bug reproduced from its
description at a line marked ``# expect: STxxx``, then the correct versions, whose weights must not depend on
safetorch, and an uneven last epoch (one rank joins early) that must not hang."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from typing import Any

import pytest

from .conftest import ROOT, clean_env

pytestmark = pytest.mark.slow

JOB = os.path.join(os.path.dirname(__file__), "distributed_job.py")
TIMEOUT = 240  # a job takes about 8 s here; a hang would run into this


def _expected() -> set[tuple[str, int]]:
    with open(JOB) as fh:
        return {(m.group(1), n) for n, line in enumerate(fh, 1) for m in [re.search(r"# expect: (ST\d{3})", line)]
                if m}


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(tmp_path: Any, launcher: str, on: bool) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str]:
    out = os.path.join(tmp_path, f"{launcher}-{'on' if on else 'off'}.json")
    report = os.path.join(tmp_path, f"{launcher}-findings.json")
    runner = ["-m", "safetorch", "--report", report] if on else []
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *runner, JOB,
               out]
    else:
        cmd = [sys.executable, *runner, JOB, out, "--spawn", _port()]
    env = clean_env(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=TIMEOUT)
    with open(out) as fh:
        return proc, json.load(fh), report


def _findings(report: str) -> dict[tuple[str, int], dict[str, Any]]:
    with open(report) as fh:
        return {(e["code"], e["line"]): e for e in json.load(fh)}


@pytest.mark.parametrize("launcher", ["torchrun", "mp.spawn"])
def test_each_distributed_bug_is_found_at_its_line_and_the_correct_versions_train_the_same(
        tmp_path: Any, launcher: str) -> None:
    on, trained_on, report = _run(tmp_path, launcher, on=True)
    # torchrun: every rank keeps the program's status (0); the runner's mp.spawn parent: 1 for the findings. Either
    # way, the uneven epoch (rank 1 joins after 3 steps, rank 0 takes 12) finished: nothing waited for rank 1.
    assert on.returncode == (0 if launcher == "torchrun" else 1), on.stderr[-4000:]
    found = _findings(report)
    assert set(found) == _expected(), (sorted(found), on.stderr[-4000:])
    assert "SafetorchInternalWarning" not in on.stderr, on.stderr[-4000:]
    st016 = sorted(line for code, line in found if code == "ST016")
    diverging = found[("ST016", st016[0])]
    assert diverging["count"] == 1  # once per job, by the comparing rank
    assert ("when step 4 begins: `0.weight` (and maybe more) on rank 1 is not rank 0's (identical when step 3 began: "
            "its update made them differ") in diverging["message"]
    for code, line in found:  # printed once for the job, at the user's line
        assert on.stderr.count(f"distributed_job.py:{line}: ") == 1, (code, line, on.stderr[-4000:])
    if launcher == "torchrun":
        bare = min(line for code, line in found if code == "ST017")
        assert diverging["ranks"] == [0] and found[("ST017", bare)]["ranks"] == [0, 1]
    off, trained_off, _ = _run(tmp_path, launcher, on=False)
    assert off.returncode == 0, off.stderr[-4000:]
    assert trained_on == trained_off


UNEVEN = """\
import sys, time
import torch, torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
with Join([model]):
    for i in range(2 if rank == 1 else 40):  # rank 1's data runs out after 2 steps
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""


def test_a_rank_that_stops_stepping_early_makes_no_one_wait(tmp_path: Any) -> None:
    # Rank 0 goes on alone for 38 steps, 6 of them looked at: no fingerprint of rank 1's will come for those.
    script = os.path.join(tmp_path, "uneven.py")
    with open(script, "w") as fh:
        fh.write(UNEVEN)
    report = os.path.join(tmp_path, "findings.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "safetorch",
           "--report", report, script]
    env = clean_env(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]  # torchrun: 0 only when every rank exited 0
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    with open(report) as fh:
        assert json.load(fh) == []
