"""One report for a job on several machines: two torchrun agents (``--nnodes 2``), each with its own ``TMPDIR`` as two
machines have, gloo on loopback, a finding only on node 0 and another only on node 1. The ranks share their findings
through the job's c10d store: the report on a shared path, rank 0's exit summary and each machine's runner status hold
both; rank 0 prints node 1's finding during the run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.slow  # two torchrun agents each

JOB = textwrap.dedent("""\
    import os
    import sys
    import time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(2)
    if rank == 0 and "clean" not in sys.argv:
        x.double()  # line 11: node 0's
    if rank == 1 and "clean" not in sys.argv:
        x.half()  # line 13: node 1's
    dist.barrier()
    if rank == 1 and "crash" in sys.argv:
        raise RuntimeError("rank 1 fails")
    time.sleep(float(os.environ.get("HOLD", "0")))  # rank 0 learns of node 1's finding while the job runs
    dist.barrier()
    dist.destroy_process_group()
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(tmp: Any, args: list[str], runner: bool, **extra: str) -> list[subprocess.CompletedProcess[str]]:
    script = os.path.join(tmp, "job.py")
    with open(script, "w") as fh:
        fh.write(JOB)
    port = _port()
    procs = []
    for node in (0, 1):
        node_tmp = os.path.join(tmp, f"node{node}")
        os.makedirs(node_tmp, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
        env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", TMPDIR=node_tmp,
                   **extra)
        launcher = [sys.executable, *(["-m", "safetorch"] if runner else []), "-m", "torch.distributed.run",
                    "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                    "--master-port", str(port), *([] if runner else ["-m", "safetorch"]), script, *args]
        procs.append(subprocess.Popen(launcher, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp,
                                      env=env))
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def _found(path: str) -> dict[tuple[str, int], dict[str, Any]]:
    with open(path) as fh:
        return {(e["rule"], e["line"]): e for e in json.load(fh)}


def test_a_two_node_job_has_one_report_and_rank_0_sees_node_1(tmp_path: Any) -> None:
    report = str(tmp_path / "report.json")  # a shared path, as on a cluster's shared file system
    node0, node1 = _two_nodes(str(tmp_path), [], runner=False, SAFETORCH_REPORT=report, HOLD="5")
    assert node0.returncode == 0 and node1.returncode == 0, node0.stderr[-3000:] + node1.stderr[-3000:]
    found = _found(report)
    assert sorted(found) == [("ST001", 11), ("ST001", 13)]
    assert found[("ST001", 11)]["ranks"] == [0] and found[("ST001", 13)]["ranks"] == [1]
    assert found[("ST001", 13)]["hosts"] == [socket.gethostname()]
    script = str(tmp_path / "job.py")
    # rank 0 printed node 1's finding once while the job ran (its thread reads the store), and lists it at exit
    assert node0.stderr.count(f"{script}:13: DiscardedConversionWarning: ST001 x.half()") == 1
    assert "(rank 1 on " in node0.stderr
    assert f"ST001 {script}:13 (x1, rank 1): x.half()" in node0.stderr
    assert f"ST001 {script}:11" in node0.stderr
    # nothing is left in either machine's temporary directory
    for node in (0, 1):
        leftover = [os.path.join(d, n) for d, _, names in os.walk(tmp_path / f"node{node}") for n in names]
        assert leftover == [], leftover


def test_the_runner_around_each_agent_exits_1_for_a_finding_on_any_node(tmp_path: Any) -> None:
    node0, node1 = _two_nodes(str(tmp_path), [], runner=True)
    assert (node0.returncode, node1.returncode) == (1, 1), node0.stderr[-3000:] + node1.stderr[-3000:]
    script = str(tmp_path / "job.py")
    for proc in (node0, node1):  # each machine's summary holds the whole job
        assert f"ST001 {script}:11" in proc.stderr and f"ST001 {script}:13" in proc.stderr
        assert "exit status 1 for these findings" in proc.stderr
    clean0, clean1 = _two_nodes(str(tmp_path), ["clean"], runner=True)
    assert (clean0.returncode, clean1.returncode) == (0, 0), clean0.stderr[-3000:] + clean1.stderr[-3000:]


def test_a_crashing_rank_keeps_its_findings_and_the_job_s_status(tmp_path: Any) -> None:
    report = str(tmp_path / "report.json")
    node0, node1 = _two_nodes(str(tmp_path), ["crash"], runner=True, SAFETORCH_REPORT=report)
    assert node1.returncode != 0 and "rank 1 fails" in node1.stderr
    assert ("ST001", 13) in _found(report)
