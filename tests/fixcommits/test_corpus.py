"""Real bugs from public fix commits and issues, each as a small program of the project's shape (tiny data, no
downloads): ``cases/<rule>_<project>.py`` is the buggy revision, its line marked ``# ST0xx: ...`` where the fix
changed it, and ``cases/<rule>_<project>_fixed.py`` the fixed one. The buggy program must be reported there, with
that rule; the fixed one must get no finding at all. Each case's docstring names the project and the commit, pull
request or issue it comes from. The one line of recall and false findings is printed at the end of the run
(`conftest.py`)."""

from __future__ import annotations

import os
import re
import runpy
import warnings
from collections.abc import Iterator

import pytest

import safetorch
from safetorch import _report

from .conftest import RESULTS

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases")
_MARK = re.compile(r"#\s*(ST0\d\d):")


def _buggy() -> list[str]:
    return sorted(name[:-3] for name in os.listdir(CASES) if name.endswith(".py") and not name.endswith("_fixed.py"))


def _marked(path: str) -> tuple[str, int]:
    with open(path) as fh:
        marks = [(m.group(1), n) for n, line in enumerate(fh, 1) if (m := _MARK.search(line))]
    assert len(marks) == 1, f"{path}: one line marked `# ST0xx:` expected, found {marks}"
    return marks[0]


def _run(path: str) -> list[warnings.WarningMessage]:
    """Run the program as `python path` would, with every check installed anew (no state from another case)."""
    safetorch.uninstall()
    safetorch.install(strict=False, ignore=())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runpy.run_path(path, run_name="__main__")
        _report._settle()  # what the exit summary would report late (a graph that died after the last forward)
    safetorch.install(strict=False, ignore=())
    kinds = (safetorch.SafetorchWarning, safetorch.SafetorchInternalWarning)
    return [w for w in caught if issubclass(w.category, kinds)]


@pytest.fixture(autouse=True)
def _quiet_torch() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("case", _buggy())
def test_the_bug_is_found_at_the_line_its_fix_changed(case: str) -> None:
    path = os.path.join(CASES, f"{case}.py")
    code, line = _marked(path)
    got = _run(path)
    shown = [(str(w.message).split(" ", 1)[0], os.path.basename(w.filename), w.lineno) for w in got]
    found = (code, os.path.basename(path), line) in shown
    RESULTS[case] = {"code": code, "found": found}
    assert found, f"{code} expected at {os.path.basename(path)}:{line}; got {shown}"


@pytest.mark.parametrize("case", _buggy())
def test_the_fixed_program_gets_no_finding(case: str) -> None:
    path = os.path.join(CASES, f"{case}_fixed.py")
    code, _ = _marked(os.path.join(CASES, f"{case}.py"))
    got = _run(path)
    RESULTS[f"{case}_fixed"] = {"code": code, "false": len(got)}
    assert got == [], [f"{os.path.basename(w.filename)}:{w.lineno}: {w.message}" for w in got]


#: Rules without a case yet, and why: ST016 needs a job of several ranks; for ST018 no public fix commit was found
#: whose shape runs in one CPU process (its wrappers that restore parameters after a step are FSDP's and apex's).
PENDING = {"ST016", "ST018"}


def test_every_rule_has_a_case() -> None:
    codes = {_marked(os.path.join(CASES, f"{case}.py"))[0] for case in _buggy()}
    assert sorted(set(safetorch.RULES) - codes - PENDING) == []
    assert not PENDING & codes, "a pending rule has a case now: take it off PENDING"
