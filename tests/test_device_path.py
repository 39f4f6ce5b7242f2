"""The accelerator path, run on CPU tensors: a training loop with every rule on never reads a device value (on a GPU,
`bench/gpu.sh` runs the same loop under ``torch.cuda.set_sync_debug_mode("error")``)."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import warnings
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


@pytest.mark.slow
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


# ST011's and ST012's decisions on the accelerator path: read once the device has computed them.

@pytest.mark.usefixtures("device_path")
def test_device_path_forgotten_zero_grad_is_reported_at_the_step_line_once_read() -> None:
    from safetorch import GradientsAccumulateWarning

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with findings() as got:
        seen = []
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
            opt.step(); line = sys._getframe().f_lineno  # noqa: E702
            seen.append(len(got))
        _deferred.poll(wait=True)
    # The second step's gradients, compared on the device, are read at the third step (one check behind): nothing is
    # said before the device has computed them.
    assert seen == [0, 0, 1]
    assert [(w.category, w.filename, w.lineno) for w in got] == [(GradientsAccumulateWarning, __file__, line)]
    assert str(got[0].message).startswith("ST011 opt.step() uses the sum of the gradients of every step so far")


def _amp_steps(limit: str, scaled_on_purpose: bool) -> tuple[list[warnings.WarningMessage], int]:
    """Two AMP steps that clip before unscale_, on the accelerator path; (the findings, the clip's line)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 4)
    with findings() as got:
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if scaled_on_purpose:
                max_norm: float | torch.Tensor = scaler._scale * 1.0 if limit == "tensor" else scaler.get_scale()
            else:
                max_norm = torch.tensor(1.0) if limit == "tensor" else 1.0
            nn.utils.clip_grad_norm_(model.parameters(), max_norm); line = sys._getframe().f_lineno  # noqa: E702
            scaler.step(opt)
            scaler.update()
        _deferred.poll(wait=True)
    return got, line


@pytest.mark.usefixtures("device_path")
@pytest.mark.parametrize("limit", ["number", "tensor"])
def test_device_path_clip_before_unscale_is_compared_on_the_device(limit: str) -> None:
    from safetorch import ClipScaledGradientsWarning

    got, line = _amp_steps(limit, scaled_on_purpose=False)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(ClipScaledGradientsWarning, __file__, line)]
    assert str(got[0].message).startswith("ST012 `nn.utils.clip_grad_norm_(model.parameters(), max_norm)` clips "
                                          "gradients still multiplied by the GradScaler's scale (65536)")


@pytest.mark.usefixtures("device_path")
@pytest.mark.parametrize("limit", ["number", "tensor"])
def test_device_path_a_limit_scaled_on_purpose_stays_silent(limit: str) -> None:
    got, _ = _amp_steps(limit, scaled_on_purpose=True)
    assert got == []


def test_a_forked_child_does_not_read_its_parents_slots() -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    _deferred.force_cpu(True, lag=100)
    w = torch.randn(3, requires_grad=True)
    (w * 2).sum().backward()
    assert _deferred.pending
    pid = os.fork()
    if pid == 0:  # the child: the parent's slots are not its own
        os._exit(0 if not _deferred.pending and not _deferred._queue and not _deferred._rings else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _deferred.pending  # the parent's are still there


# The corners of the facility and of ST006's accelerator path.

@pytest.mark.usefixtures("device_path")
def test_a_value_on_a_device_without_an_adapter_is_not_read() -> None:
    seen: list[object] = []
    assert _deferred.check(torch.empty((), device="meta"), lambda v, p: seen.append(v), None, "test") is False
    assert seen == [] and not _deferred.pending


@pytest.mark.usefixtures("device_path")
def test_slots_are_read_without_numpy_too_and_cleared_checks_never_call_back(monkeypatch) -> None:
    _deferred.force_cpu(True, lag=100)
    seen: list[object] = []
    assert _deferred.check(torch.tensor(2.5), lambda v, p: seen.append(("kept", v)), None, "kept")
    assert _deferred.check(torch.tensor([1.0, 2.0]), lambda v, p: seen.append(("pair", v)), None, "kept")
    assert _deferred.check(torch.tensor(7.0), lambda v, p: seen.append(("cleared", v)), None, "gone")
    _deferred.clear("gone")
    assert _deferred._numpy(torch.empty(2, device="meta")) is None  # what a torch without numpy gives
    for slot in _deferred._queue:
        monkeypatch.setattr(slot, "host", None)
    assert all(b.shape == (_deferred.RING, 2) for b in _deferred.host_buffers())
    _deferred.poll(wait=True)
    assert seen == [("kept", 2.5), ("pair", [1.0, 2.0])]


@pytest.mark.usefixtures("device_path")
def test_the_fork_handler_forgets_the_parents_slots() -> None:
    (torch.randn(3, requires_grad=True) * 2).sum().backward()
    assert _deferred.pending
    _deferred._after_fork_in_child()  # what a forked child runs
    assert not _deferred.pending and not _deferred._queue and not _deferred._rings


@pytest.mark.usefixtures("device_path")
def test_device_path_losses_of_one_element_vectors_lists_and_direct_calls() -> None:
    from safetorch.checks import non_finite_loss

    w = torch.randn(3, requires_grad=True)
    with findings() as got:
        (w * 2).backward(torch.ones(3))  # a finite vector: all finite, silent
        one = (w.sum() * float("nan")).reshape(1)
        one.backward(torch.ones(1)); line = sys._getframe().f_lineno  # noqa: E702
        torch.autograd.backward([(w * 2).sum()])  # a list: polls, and is looked at
        non_finite_loss._before_backward((w * float("nan")).sum())  # not from the backward patch: no frame, silent
        _deferred.poll(wait=True)
    assert [(w_.lineno, str(w_.message).split(" when")[0]) for w_ in got] == [(line, "ST006 one is nan")]


@pytest.mark.usefixtures("device_path")
def test_device_path_a_backward_called_by_torch_itself_is_torchs() -> None:
    w = torch.randn(3, requires_grad=True)
    loss = (w * float("nan")).sum()
    other = (w * float("inf")).sum()
    namespace = {"torch": torch, "loss": loss, "other": other}
    with findings() as got:
        # code of torch's own files calling backward: loss.backward() is reported at this test's line (the first
        # frame outside torch), torch.autograd.backward(...) from torch's code is not the program's
        exec(compile("loss.backward()", torch.__file__, "exec"), namespace); line = sys._getframe().f_lineno  # noqa: E702
        exec(compile("torch.autograd.backward(other)", torch.__file__, "exec"), namespace)
        _deferred.poll(wait=True)
    assert [w_.lineno for w_ in got] == [line]


@pytest.mark.slow
def test_the_accelerator_path_is_covered_by_the_cpu_runs(tmp_path: os.PathLike[str]) -> None:
    """The lines a GPU run executes run in CI: coverage of the deferred facility and of ST006 (whose every
    accelerator branch goes through it) from this file's and ST006's own tests, on CPU tensors."""
    pytest.importorskip("coverage")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    env.update({"COVERAGE_FILE": os.path.join(os.fspath(tmp_path), ".coverage"),
                "PYTHONPATH": os.pathsep.join([ROOT, LIBRARIES])})
    include = "safetorch/_deferred.py,safetorch/checks/non_finite_loss.py"
    run = subprocess.run([sys.executable, "-m", "coverage", "run", f"--include={include}", "-m", "pytest", "-q",
                          "-p", "no:cacheprovider", "tests/test_non_finite_loss.py", "tests/test_device_path.py",
                          "-k", "not covered and not grows and not every_rule and not recorder"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    report = subprocess.run([sys.executable, "-m", "coverage", "report", "-m", "--fail-under=95"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert report.returncode == 0, report.stdout
    for name in ("_deferred.py", "non_finite_loss.py"):
        line = next(ln for ln in report.stdout.splitlines() if name in ln)
        assert int(line.split()[3].rstrip("%")) >= 95, report.stdout
