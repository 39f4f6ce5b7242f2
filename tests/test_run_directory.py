"""The run directory and the report path as another local user would attack them, and as a long job meets them.

A torchrun job's ranks meet at a directory named after the job: a name another user can compute. It lives inside
``$TMPDIR/safetorch-<uid>``, which only this user may enter; anything else found at those names (another user's
directory, one open to others, a symbolic link) is refused with one line, and the process reports alone, its findings
kept. Parts are read field by field; a report path is written where it points, never replaced when it is not a
regular file. Each test runs the program as a user does, in a subprocess, with ``TMPDIR`` a directory of the test.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import clean_env, run_runner

UID = os.geteuid()
FINDING = textwrap.dedent("""\
    import torch
    import safetorch
    x = torch.ones(2)
    x.double()  # line 4
""")


def _job_env(tmp: str, report: str, **extra: str) -> dict[str, str]:
    """One rank of a torchrun job, as the agent starts it (no torchrun needed to take the rank's code path)."""
    return clean_env(TMPDIR=tmp, TORCHELASTIC_RUN_ID="none", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                     GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", SAFETORCH_REPORT=report, **extra)


def _run(script: str, env: dict[str, str], cwd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def _write(tmp: Any, name: str, source: str) -> str:
    path = os.path.join(str(tmp), name)
    with open(path, "w") as fh:
        fh.write(source)
    return path


def _findings(path: str) -> list[tuple[str, int]]:
    with open(path) as fh:
        return [(e["rule"], e["line"]) for e in json.load(fh)]


@pytest.fixture
def intruder() -> Iterator[int]:
    """Another local user: made with useradd and removed after, where this test runs as root."""
    if UID != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make a second user")
    name = f"st-intruder-{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _as(uid: int, argv: list[str]) -> None:
    """Run ``argv`` as ``uid`` (the other user plants its files itself)."""
    subprocess.run(argv, check=True, capture_output=True, user=uid, group=pwd.getpwuid(uid).pw_gid)


def _job_dir(tmp: str, env: dict[str, str]) -> str:
    """The job directory's path, as the rank computes it (the other user can compute it the same way)."""
    probe = "import os; from safetorch import _run; print(_run._torchrun_dir())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**env, "SAFETORCH_DISABLE": "1"})  # makes nothing
    path = out.stdout.strip()
    assert path.startswith(os.path.join(tmp, f"safetorch-{UID}", "job-")), path
    return path


def test_a_torchrun_rank_makes_its_job_directory_private_and_removes_it(tmp_path: Any) -> None:
    script = _write(tmp_path, "train.py", FINDING + textwrap.dedent("""\
        import os, stat
        from safetorch import _run
        for path in (os.path.dirname(_run.directory()), _run.directory()):
            print(oct(stat.S_IMODE(os.lstat(path).st_mode)), os.lstat(path).st_uid)
        for name in os.listdir(_run.directory()):
            print(name.rsplit(".", 1)[-1], oct(stat.S_IMODE(os.lstat(os.path.join(_run.directory(), name)).st_mode)))
    """))
    report = str(tmp_path / "report.json")
    env = _job_env(str(tmp_path), report)
    job = _job_dir(str(tmp_path), env)
    proc = _run(script, env, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == [f"0o700 {UID}", f"0o700 {UID}"]
    assert sorted(lines[2:]) == ["jsonl 0o600", "live 0o600"]  # the part and the rank's place in the count
    assert _findings(report) == [("ST001", 4)]
    assert not os.path.exists(job)  # the last rank out removed it
    assert os.listdir(os.path.dirname(job)) == []


def test_a_job_directory_planted_by_another_user_is_refused(intruder: int) -> None:
    """The other user makes the private parent first, open to all, with a symbolic link where the rank's part will
    be and a part of its own: nothing is written through the link, the planted finding is not reported, the rank's
    own finding is. ``TMPDIR`` is a directory like /tmp: everyone may create in it (sticky)."""
    import pathlib
    import tempfile

    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="st-shared-tmp-", dir="/tmp"))
    os.chmod(tmp_path, 0o1777)
    try:
        _planted(tmp_path, intruder)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _planted(tmp_path: Any, intruder: int) -> None:
    victim = _write(tmp_path, "victim.txt", "precious\n")
    os.chmod(victim, 0o666)
    report = str(tmp_path / "report.json")
    env = _job_env(str(tmp_path), report)
    job = _job_dir(str(tmp_path), env)
    parent = os.path.dirname(job)
    _as(intruder, ["mkdir", "-m", "0777", "-p", parent])
    _as(intruder, ["mkdir", "-m", "0777", job])
    planted = json.dumps({"code": "ST001", "file": "/etc/passwd", "line": 1, "message": "ST001 planted", "count": 1,
                          "pid": 1, "rank": 0})
    _as(intruder, ["sh", "-c", f"printf '%s\\n' '{planted}' > {job}/1.jsonl"])
    for pid in range(os.getpid(), os.getpid() + 200):  # the rank's pid is near ours: a link for each candidate
        _as(intruder, ["ln", "-s", victim, f"{job}/{pid}.jsonl"])
    script = _write(tmp_path, "train.py", FINDING)
    proc = _run(script, env, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"safetorch: the run directory {parent} belongs to another user (uid {intruder})" in proc.stderr
    assert proc.stderr.count("refused") == 1
    assert open(victim).read() == "precious\n"
    assert _findings(report) == [("ST001", 4)]  # its own, not the planted one
    assert "planted" not in proc.stderr


@pytest.mark.parametrize("plant", ["open to others", "symbolic link"])
def test_a_private_directory_that_is_not_private_is_refused(tmp_path: Any, plant: str) -> None:
    report = str(tmp_path / "report.json")
    env = _job_env(str(tmp_path), report)
    parent = os.path.dirname(_job_dir(str(tmp_path), env))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if plant == "open to others":
        os.mkdir(parent)
        os.chmod(parent, 0o777)
    else:
        os.symlink(elsewhere, parent)
    script = _write(tmp_path, "train.py", FINDING)
    proc = _run(script, env, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    why = "is open to other users (mode 777)" if plant == "open to others" else "is a symbolic link"
    assert f"safetorch: the run directory {parent} {why}: refused" in proc.stderr
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    assert _findings(report) == [("ST001", 4)]
    assert "ST001" in proc.stderr  # the exit summary still has it


def test_an_inherited_run_directory_that_is_not_private_is_refused(tmp_path: Any) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    report = str(tmp_path / "report.json")
    script = _write(tmp_path, "train.py", FINDING)
    proc = _run(script, clean_env(SAFETORCH_RUN_DIR=str(shared), SAFETORCH_REPORT=report), str(tmp_path))
    assert f"the run directory {shared} (SAFETORCH_RUN_DIR) is open to other users" in proc.stderr
    assert list(shared.iterdir()) == []
    assert _findings(report) == [("ST001", 4)]


def test_malformed_parts_are_skipped_with_a_warning_and_the_rest_kept(tmp_path: Any) -> None:
    """Lines that are JSON but not findings (a list, a count that is a word, a missing field) cannot drop the
    report: they are skipped, with one line saying so, and every valid finding stays."""
    script = _write(tmp_path, "train.py", FINDING + textwrap.dedent("""\
        import json, os
        from safetorch import _run
        good = {"code": "ST004", "file": __file__, "line": 4, "message": "ST004 from a child", "count": 2,
                "pid": 4242, "rank": None}
        with open(os.path.join(_run.directory(), "4242.jsonl"), "w") as fh:
            for line in ([1], {**good, "count": "many"}, {**good, "line": "4"}, {"code": "ST001"}, "text", good):
                fh.write(json.dumps(line) + "\\n")
            fh.write('{"code": "ST0')  # a line cut short by a kill: skipped without a word
    """))
    report = str(tmp_path / "report.json")
    proc = run_runner(["--report", report, script], str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert sorted(_findings(report)) == [("ST001", 4), ("ST004", 4)]
    assert proc.stderr.count("safetorch: skipped") == 1
    assert "skipped 5 malformed line(s) of " in proc.stderr and "4242.jsonl; the other findings are kept" in proc.stderr
    assert "ST001 x.double()" in proc.stderr


def test_the_run_directory_removed_mid_run_loses_nothing_of_the_process(tmp_path: Any) -> None:
    """A tmp cleaner removes the run directory during a job of days: the document and the report still hold every
    finding the process made, before and after."""
    script = _write(tmp_path, "train.py", FINDING + textwrap.dedent("""\
        import os, shutil
        shutil.rmtree(os.environ["SAFETORCH_RUN_DIR"])
        print("the program's own output")
        x.float()  # line 8
    """))
    report = str(tmp_path / "report.json")
    proc = run_runner(["--format", "json", "--report", report, script], str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert sorted(_findings(report)) == [("ST001", 4), ("ST001", 8)]
    proc = run_runner(["--format", "json", script], str(tmp_path))
    document = proc.stdout[proc.stdout.index("["):]
    assert sorted((e["rule"], e["line"]) for e in json.loads(document)) == [("ST001", 4), ("ST001", 8)]


def test_import_in_a_deleted_working_directory(tmp_path: Any) -> None:
    code = textwrap.dedent(f"""\
        import os, torch  # torch itself needs a working directory to load
        os.chdir({str(tmp_path / "gone")!r})
        os.rmdir({str(tmp_path / "gone")!r})
        import safetorch
        torch.ones(2).double()
    """)
    (tmp_path / "gone").mkdir()
    report = str(tmp_path / "report.json")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=clean_env(SAFETORCH_REPORT=report), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert _findings(report) == [("ST001", 5)]


# --- the report path --------------------------------------------------------------------------------------------


def test_a_report_on_a_device_is_written_through_not_replaced(tmp_path: Any) -> None:
    """``SAFETORCH_REPORT=/dev/null`` as root (a container's user) must leave the device a device: tried on a null
    device of the test's own."""
    if UID != 0:
        pytest.skip("needs root to make a device node")
    null = str(tmp_path / "null")
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    script = _write(tmp_path, "train.py", FINDING)
    proc = _run(script, clean_env(SAFETORCH_REPORT=null), str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    assert "could not be written" not in proc.stderr
    assert [n for n in os.listdir(tmp_path) if n.startswith(".safetorch-")] == []


def test_a_report_through_a_symlink_is_written_at_its_target(tmp_path: Any) -> None:
    target = _write(tmp_path, "real.json", "stale")
    os.chmod(target, 0o640)
    link = str(tmp_path / "link.json")
    os.symlink(target, link)
    script = _write(tmp_path, "train.py", FINDING)
    proc = _run(script, clean_env(SAFETORCH_REPORT=link), str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert os.path.islink(link) and os.readlink(link) == target
    assert _findings(target) == [("ST001", 4)]
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640  # the file keeps its mode


def test_a_report_into_a_fifo_and_a_pipe_descriptor(tmp_path: Any) -> None:
    """A FIFO, and a shell's process substitution (``--report >(jq .)``, a ``/dev/fd/N``), get the document."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    got: dict[str, str] = {}

    def read() -> None:
        with open(fifo) as fh:
            got["fifo"] = fh.read()

    reader = threading.Thread(target=read)
    reader.start()
    script = _write(tmp_path, "train.py", FINDING)
    proc = _run(script, clean_env(SAFETORCH_REPORT=fifo), str(tmp_path))
    reader.join(60)
    assert proc.returncode == 0, proc.stderr
    assert [(e["rule"], e["line"]) for e in json.loads(got["fifo"])] == [("ST001", 4)]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)

    read_end, write_end = os.pipe()
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=clean_env(SAFETORCH_REPORT=f"/dev/fd/{write_end}"), pass_fds=(write_end,))
    os.close(write_end)
    with os.fdopen(read_end) as fh:
        assert [(e["rule"], e["line"]) for e in json.loads(fh.read())] == [("ST001", 4)]
    assert proc.returncode == 0, proc.stderr


def test_a_report_that_cannot_be_written_says_where_and_why_and_keeps_the_findings(tmp_path: Any) -> None:
    path = str(tmp_path / "no" / "such" / "dir" / "report.json")
    script = _write(tmp_path, "train.py", FINDING)
    proc = _run(script, clean_env(SAFETORCH_REPORT=path), str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"safetorch: the report {path!r} could not be written (FileNotFoundError" in proc.stderr
    assert f"ST001 {script}:4 (x1)" in proc.stderr
