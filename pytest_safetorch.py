"""safetorch's pytest plugin: ``pytest --safetorch`` (or ``--safetorch-strict``) installs the checks for a test run.

Registered by entry point, so it is there once safetorch is installed, but it imports nothing and changes nothing
unless asked: it lives outside the ``safetorch`` package because importing that package installs the checks.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("safetorch", "safetorch: PyTorch pitfall checks")
    group.addoption("--safetorch", action="store_true", default=None,
                    help="install safetorch's checks for the test run: findings appear in the warnings summary")
    group.addoption("--safetorch-strict", action="store_true", default=None,
                    help="like --safetorch, and a finding fails its test with safetorch.SafetorchError")
    parser.addini("safetorch", type="bool", default=False, help="install safetorch's checks (as --safetorch)")
    parser.addini("safetorch_strict", type="bool", default=False,
                  help="install safetorch's checks in strict mode (as --safetorch-strict)")


def pytest_configure(config: Any) -> None:
    strict = bool(config.getoption("safetorch_strict") or config.getini("safetorch_strict"))
    enabled = strict or bool(config.getoption("safetorch") or config.getini("safetorch"))
    if not enabled:
        return
    import safetorch
    from safetorch import _report

    safetorch.install(strict=True if strict else None)  # not strict: SAFETORCH_STRICT or [tool.safetorch] decide
    _report.summary_by_host = True  # the summary goes into pytest's own, below, not after its last line
    config.addinivalue_line("markers", "safetorch: safetorch's checks are installed for this run")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """safetorch's findings as a section of pytest's summary, before its final line."""
    import sys

    report = sys.modules.get("safetorch._report")
    if report is None or not getattr(report, "summary_by_host", False):
        return
    text = report.format_summary() if any(report.shown_here(s) for s in report.findings()) else ""
    if text:
        terminalreporter.section("safetorch")
        for line in text.splitlines():
            terminalreporter.line(line)



def _finding(excinfo: Any) -> bool:
    import sys

    exceptions = sys.modules.get("safetorch._exceptions")
    return exceptions is not None and isinstance(excinfo.value, (exceptions.SafetorchError,
                                                                 exceptions.SafetorchWarning))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    """A finding that fails a test (strict mode, or a warning filter set to error): its traceback ends on the test's
    line, not in torch or safetorch, and the short summary starts with the finding itself, not its type's name."""
    finding = call.excinfo is not None and _finding(call.excinfo)
    if finding:
        from _pytest._code.code import Traceback

        from safetorch._report import prune_traceback

        prune_traceback(call.excinfo.tb)  # in place: the exception's own __traceback__ is this chain too
        call.excinfo.traceback = Traceback(call.excinfo.tb)
    outcome = yield
    crash = getattr(getattr(outcome.get_result(), "longrepr", None), "reprcrash", None)
    if finding and crash is not None:
        crash.message = str(call.excinfo.value)
