"""The fix-commit corpus's one line: how many of the real bugs are found at the line their fix changed, and how many
findings the fixed programs get (each should get none)."""

from __future__ import annotations

from typing import Any

import pytest

#: Filled by test_corpus.py as the cases run: case name -> (found at the fixed line, findings on the fixed program).
RESULTS: dict[str, dict[str, Any]] = {}


def summary() -> str | None:
    bugs = [r for r in RESULTS.values() if "found" in r]
    fixed = [r for r in RESULTS.values() if "false" in r]
    if not bugs and not fixed:
        return None
    found = sum(r["found"] for r in bugs)
    false = sum(r["false"] for r in fixed)
    rules = len({r["code"] for r in RESULTS.values()})
    recall = f"{100 * found / len(bugs):.0f}%" if bugs else "n/a"
    return (f"fix-commit corpus: {found} of {len(bugs)} real bugs found at the fixed line (recall {recall}), "
            f"{false} false findings on {len(fixed)} fixed programs, {rules} rules")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    line = summary()
    if line is not None:
        terminalreporter.write_line(line)
