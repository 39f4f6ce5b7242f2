from __future__ import annotations

from typing import Any

from . import COUNTS


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if COUNTS["modules"] or COUNTS["ops"]:
        terminalreporter.write_line(
            f"safetorch compat corpus: {len(COUNTS['modules'])} module_db modules / {COUNTS['module samples']} "
            f"samples (train and eval), {len(COUNTS['ops'])} op_db ops / {COUNTS['op samples']} samples: "
            f"identical with and without safetorch")
