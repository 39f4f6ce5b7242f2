"""A run is all its processes: findings of torchrun ranks, mp.spawn and multiprocessing children, DataLoader workers
and killed children reach the one report, run as users run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from .conftest import clean_env

# torchrun jobs, spawned and forked children: several Python processes each.
pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    return clean_env(**{"OMP_NUM_THREADS": "1", **extra})


def _write(tmp_path: Any, name: str, source: str) -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "w") as fh:
        fh.write(textwrap.dedent(source))
    return path


def _report(path: str) -> dict[tuple[str, int], dict[str, Any]]:
    with open(path) as fh:
        return {(e["code"], e["line"]): e for e in json.load(fh)}


RANKS = """\
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(2)
    x.double()  # line 7: both ranks (a shared finding)
    if rank == 1:
        (torch.ones(1, requires_grad=True) * float("nan")).sum().backward()  # line 9: rank 1's NaN (per rank)
        x.float()  # line 10: a shared finding only rank 1 makes
    dist.barrier()
    dist.destroy_process_group()
"""


def test_a_torchrun_job_has_every_ranks_findings_in_one_report_every_time(tmp_path: Any) -> None:
    script = _write(tmp_path, "ranks.py", RANKS)
    for attempt in range(4):  # several jobs: losing a rank's part of the report would be a race
        report = os.path.join(tmp_path, f"findings{attempt}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "safetorch", script]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path,
                              env=_env(SAFETORCH_REPORT=report), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = _report(report)
        assert sorted(found) == [("ST001", 7), ("ST001", 10), ("ST006", 9)], (attempt, found)
        assert found[("ST001", 7)]["ranks"] == [0, 1] and found[("ST001", 7)]["count"] == 2
        assert found[("ST006", 9)]["ranks"] == [1] and "[rank 1]" in found[("ST006", 9)]["message"]
        assert found[("ST001", 10)]["ranks"] == [1]
        # printed: the shared one once for the job, rank 1's NaN by rank 1, and what only rank 1 saw in its summary
        assert proc.stderr.count("DiscardedConversionWarning: ST001 x.double()") == 1
        assert proc.stderr.count("NonFiniteLossWarning: ST006 [rank 1]") == 1
        assert f"ST001 {script}:10 (x1): x.float() returned x itself" in proc.stderr


def test_a_torchrun_job_on_the_accelerator_path_loses_no_rank_s_finding(tmp_path: Any) -> None:
    # The GPU code path (forced on CPU tensors): rank 1's NaN is read at its exit, before its part of the report.
    script = _write(tmp_path, "ranks.py", RANKS)
    report = os.path.join(tmp_path, "findings.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "safetorch", script]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path,
                          env=_env(SAFETORCH_REPORT=report, SAFETORCH_DEFERRED_CPU="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = _report(report)
    assert sorted(found) == [("ST001", 7), ("ST001", 10), ("ST006", 9)], found
    assert found[("ST006", 9)]["ranks"] == [1] and "[rank 1]" in found[("ST006", 9)]["message"]
    assert proc.stderr.count("NonFiniteLossWarning: ST006 [rank 1]") == 1


HOGWILD = """\
    import torch
    import torch.multiprocessing as mp


    def train(rank, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(4, 3)
        x.double()  # line 8: every worker discards a conversion
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()


    if __name__ == "__main__":
        model = torch.nn.Linear(3, 1)
        model.share_memory()
        mp.spawn(train, args=(model,), nprocs=2)
        print("trained")
"""


def test_mp_spawn_children_are_checked_under_the_runner(tmp_path: Any) -> None:
    script = _write(tmp_path, "hogwild.py", HOGWILD)
    report = os.path.join(tmp_path, "findings.json")
    proc = subprocess.run([sys.executable, "-m", "safetorch", "--report", report, script], capture_output=True,
                          text=True, cwd=tmp_path, env=_env(), timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the children's findings count in the runner's status
    assert "trained" in proc.stdout
    found = _report(report)
    assert list(found) == [("ST001", 8)] and len(found[("ST001", 8)]["pids"]) == 2
    assert proc.stderr.count("DiscardedConversionWarning: ST001 x.double()") == 1  # once for the run
    assert "1 of them from 2 other process(es) of this run" in proc.stderr
    assert proc.stderr.count(" finding(s) at ") == 1  # one summary: the children print none


FORKED = """\
    import multiprocessing as mp
    import torch
    import safetorch


    def train(model):
        x = torch.ones(2, 3)
        x.half()  # line 8: in the forked child, which multiprocessing ends with os._exit
        model(x).sum().backward()


    if __name__ == "__main__":
        model = torch.nn.Linear(3, 1)
        ctx = mp.get_context("fork")
        children = [ctx.Process(target=train, args=(model,)) for _ in range(2)]
        for c in children:
            c.start()
        for c in children:
            c.join()
        print("exit codes", [c.exitcode for c in children])
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no fork")
def test_findings_of_forked_children_reach_the_summary_and_the_report(tmp_path: Any) -> None:
    script = _write(tmp_path, "forked.py", FORKED)
    report = os.path.join(tmp_path, "findings.json")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(SAFETORCH_REPORT=report), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exit codes [0, 0]" in proc.stdout
    found = _report(report)
    assert list(found) == [("ST001", 8)] and len(found[("ST001", 8)]["pids"]) == 2
    assert f"ST001 {script}:8 (x2, pid " in proc.stderr  # in the parent's summary


LOADER = """\
    import torch
    from torch.utils.data import DataLoader, Dataset


    class Images(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            x = torch.full((3,), float(i))
            x.float()  # line 11: in a spawned DataLoader worker
            return x


    if __name__ == "__main__":
        loader = DataLoader(Images(), batch_size=2, num_workers=2, multiprocessing_context="spawn")
        print("batches", sum(1 for _ in loader))
"""


def test_a_spawned_dataloader_workers_finding_reaches_the_report(tmp_path: Any) -> None:
    script = _write(tmp_path, "loader.py", LOADER)
    report = os.path.join(tmp_path, "findings.json")
    proc = subprocess.run([sys.executable, "-m", "safetorch", "--report", report, script], capture_output=True,
                          text=True, cwd=tmp_path, env=_env(), timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # a worker's finding counts in the runner's status
    assert "batches 4" in proc.stdout
    found = _report(report)
    assert list(found) == [("ST001", 11)] and found[("ST001", 11)]["count"] >= 2
    assert proc.stderr.count("DiscardedConversionWarning: ST001 x.float()") == 1  # not once per worker
    assert proc.stderr.count(" finding(s) at ") == 1  # one summary


KILLED = """\
    import multiprocessing as mp
    import os
    import signal
    import torch
    import safetorch


    def child():
        x = torch.ones(2)
        x.double()  # line 10: written when made
        os.kill(os.getpid(), signal.SIGKILL)
        x.float()  # line 12: never reached


    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=child)
        p.start()
        p.join()
        print("exit code", p.exitcode)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no SIGKILL")
def test_a_killed_child_loses_only_what_it_had_not_written(tmp_path: Any) -> None:
    script = _write(tmp_path, "killed.py", KILLED)
    report = os.path.join(tmp_path, "findings.json")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(SAFETORCH_REPORT=report), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exit code -9" in proc.stdout
    assert list(_report(report)) == [("ST001", 10)]


FSDP2 = """\
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fully_shard(model)
    model.eval()  # kept in eval mode while it trains
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)

    def step(x):
        return model(x).pow(2).mean()  # line 13

    for _ in range(3):
        step(torch.randn(3, 4, generator=g)).item()  # a validation through the helper, without no_grad
    for _ in range(3):
        loss = step(torch.randn(3, 4, generator=g))  # then training through the same line
        opt.zero_grad()
        loss.backward()
        opt.step()
    total = sum(p.full_tensor().double().sum().item() for p in model.parameters())
    for r in range(2):
        if r == rank:
            print(f"rank {rank} weights {total:.17g} loss {loss.item():.17g}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
"""


def test_an_fsdp2_evaluation_is_reported_and_training_through_it_is_bit_identical(tmp_path: Any) -> None:
    """FSDP2 registers tensor hooks in its forward (torch's own: no sign that the program needs the graph); the
    evaluation is reported, and the training through the same line recomputes the forwards ST003's act ran."""
    pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("no FSDP2 in this torch")
    script = _write(tmp_path, "fsdp2.py", FSDP2)
    runs = {}
    for name, extra in (("on", {}), ("off", {"SAFETORCH_DISABLE": "1"})):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "safetorch", script]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=_env(**extra), timeout=300)
        assert proc.returncode == 0, f"safetorch {name}: {proc.stderr[-3000:]}"
        runs[name] = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
        if name == "on":
            assert f"{script}:13: EvalModeGradWarning: ST003 model (FSDPSequential)" in proc.stderr
    assert len(runs["on"]) == 2 and runs["on"] == runs["off"]


FOLLOWER_AT_EXIT = """\
    import datetime, os, time
    import torch.distributed as dist
    import safetorch
    from safetorch import _run

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    _run._state.update(store=store, store_pid=os.getpid(), world=2, grank=0, published=0)
    _run.joined_group()  # global rank 0 of a job of two: its follower reads the job's store every 2 s
    follower = _run._state["follower"]
    time.sleep(0.2)
    started = time.monotonic()
    _run.gather()  # what the exit does first
    print(f"stopped {not follower.is_alive()} within {time.monotonic() - started < 5}", flush=True)
"""


def test_rank_0_s_follower_is_stopped_before_the_interpreter_finalizes(tmp_path: Any) -> None:
    """A daemon thread still inside a call of the job's store when the interpreter finalizes aborts the process
    ("terminate called without an active exception", SIGABRT) after a run that went well; the exit stops the follower
    and waits for it, without waiting out its poll interval."""
    script = _write(tmp_path, "follower.py", FOLLOWER_AT_EXIT)
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(SAFETORCH_JOB_WAIT="0"), timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "stopped True within True\n"), proc.stderr[-2000:]
