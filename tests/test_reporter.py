"""The reporter as a user sees it: the line, the traceback in strict mode, -W filters, the exit summary."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import textwrap

from .conftest import run_python

PROGRAM = textwrap.dedent("""\
    import torch
    import safetorch
    x = torch.ones(2)
    for _ in range(3):
        x.double()
    y = x.float()
    print("done", y.dtype)
""")


def test_strict_traceback_ends_on_the_users_line(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "prog.py")
    with open(script, "w") as fh:
        fh.write(PROGRAM)
    proc = run_python(f"import runpy; runpy.run_path({script!r}, run_name='__main__')",
                      env={"SAFETORCH_STRICT": "1"})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    error = next(i for i, ln in enumerate(lines) if ln.startswith("safetorch.SafetorchError: "))
    assert lines[error].startswith("safetorch.SafetorchError: ST001 x.double() returns a copy")
    assert lines[error + 1:] == [  # strict mode's findings are in the exit summary (and JSON report) too
        "safetorch: 1 finding(s) at 1 occurrence(s)",
        f"  ST001 {script}:5 (x1): x.double() returns a copy and its result is discarded; x is unchanged. "
        "Write: x = x.double() (safetorch explain ST001)"]  # raised, never shown as a warning: in full
    frames = [ln for ln in lines[:error] if ln.startswith('  File "')]
    assert frames[-1] == f'  File "{script}", line 5, in <module>'
    assert "done" not in proc.stdout


def test_warning_filters_by_code_with_W(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "prog.py")
    with open(script, "w") as fh:
        fh.write(PROGRAM)
    shown = run_python(f"import runpy; runpy.run_path({script!r}, run_name='__main__')")
    assert f"{script}:5: DiscardedConversionWarning: ST001 x.double()" in shown.stderr
    assert shown.stderr.count("DiscardedConversionWarning") == 1
    quiet = run_python(f"import warnings; warnings.filterwarnings('ignore', '^ST001'); import runpy; "
                       f"runpy.run_path({script!r}, run_name='__main__')", env={"SAFETORCH_REPORT": "0"})
    assert "Warning" not in quiet.stderr and "done torch.float32" in quiet.stdout


def test_exit_summary_and_json(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "prog.py")
    report = os.path.join(tmp_path, "report.json")
    with open(script, "w") as fh:
        fh.write(PROGRAM)
    proc = run_python(f"import runpy; runpy.run_path({script!r}, run_name='__main__')",
                      env={"SAFETORCH_REPORT": report})
    assert proc.returncode == 0
    assert f"  ST001 {script}:5 (x3): x.double() returns a copy" in proc.stderr
    with open(report) as fh:
        data = json.load(fh)
    pids = data[0].pop("pids")  # the processes of the run that reported it: this one
    assert len(pids) == 1 and isinstance(pids[0], int) and data[0].pop("pid") == pids[0]
    first_seen = datetime.datetime.fromisoformat(data[0].pop("first_seen"))
    assert abs((datetime.datetime.now(datetime.timezone.utc) - first_seen).total_seconds()) < 600
    assert data == [{"rule": "ST001", "name": "discarded-conversion", "path": script, "abspath": script, "line": 5,
                     "count": 3, "sampled": False, "rank": None, "ranks": [],
                     "hosts": [socket.gethostname()], "message": data[0]["message"],
                     "code": "ST001", "file": script,
                     # the call's place and text, from the bytecode positions (none before Python 3.11)
                     **({"col": 4, "end_line": 5, "end_col": 14, "source": "x.double()"} if sys.version_info >= (3, 11)
                        else {"col": None, "end_line": None, "end_col": None, "source": None})}]
    assert data[0]["message"].startswith("ST001 x.double()")
    assert data[0]["message"].endswith("Write: x = x.double() (safetorch explain ST001)")
    silent = run_python(f"import runpy; runpy.run_path({script!r}, run_name='__main__')",
                        env={"SAFETORCH_REPORT": "0"})
    assert "safetorch:" not in silent.stderr


def test_internal_failure_leaves_the_programs_output_unchanged(tmp_path: os.PathLike[str]) -> None:
    train = textwrap.dedent("""\
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(16, 4).double().float(), torch.randn(16, 1)
        for step in range(5):
            loss = torch.nn.functional.mse_loss(model(x.float().contiguous()), y.detach())
            opt.zero_grad(); loss.backward(); opt.step()
            print(step, repr(loss.item()))
    """)
    script = os.path.join(tmp_path, "train.py")
    with open(script, "w") as fh:
        fh.write(train)
    plain = run_python(f"import runpy; runpy.run_path({script!r})")
    broken = run_python(
        "import safetorch, safetorch._callsite as c\n"
        "def boom(*a, **k): raise RuntimeError('injected')\n"
        "c._discarded_slow = boom\n"
        f"import runpy; runpy.run_path({script!r})")
    assert plain.returncode == broken.returncode == 0, broken.stderr
    assert broken.stdout == plain.stdout and plain.stdout.count("\n") == 5
    assert broken.stderr.count("SafetorchInternalWarning") == 1
    assert "check ST001 failed internally (RuntimeError: injected)" in broken.stderr


def test_no_exit_summary_in_an_interactive_session() -> None:
    import subprocess
    import sys

    from .conftest import ROOT

    code = "import torch, safetorch\nx = torch.ones(2)\nx.double()\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-i", "-c", code], input="", capture_output=True, text=True, env=env,
                          timeout=300)
    assert "DiscardedConversionWarning: ST001" in proc.stderr  # the finding itself is shown
    assert "finding(s)" not in proc.stderr  # but no summary when the session is interactive


def test_a_concise_warning_reaches_every_showwarning_as_one_line() -> None:
    """Python's own display, a recorder (pytest's) and a replacement (logging.captureWarnings) all get the warning
    with an empty source line, and the program's showwarning is back in place after it."""
    import dataclasses
    import warnings

    import torch

    from safetorch import DiscardedConversionWarning, _config

    from .conftest import lineno

    shown: list[tuple[str, int, str | None]] = []

    def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: object = None, line: str | None = None) -> None:
        shown.append((str(message), lineno, line))

    before = _config.current
    _config.current = dataclasses.replace(before, format="concise")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = showwarning
            x = torch.ones(2)
            x.double(); line = lineno()  # noqa: E702
            assert warnings.showwarning is showwarning
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            x.float(); recorded = lineno()  # noqa: E702
    finally:
        _config.current = before
    assert shown == [("ST001 x.double() returns a copy and its result is discarded. Write: x = x.double() "
                      "(safetorch explain ST001)", line, "")]
    assert [(w.category, w.lineno, w.line) for w in got] == [(DiscardedConversionWarning, recorded, "")]
    assert warnings.formatwarning(str(got[0].message), got[0].category, got[0].filename, got[0].lineno,
                                  got[0].line).count("\n") == 1
