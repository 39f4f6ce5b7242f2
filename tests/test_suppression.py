"""``# safetorch: ignore[ST001]`` on a line silences that rule on that line only, as ``# noqa`` does for linters."""

from __future__ import annotations

import json
import os
import textwrap
from typing import Any

import torch
import torch.nn as nn

import safetorch
from safetorch import DiscardedConversionWarning, _report

from .conftest import findings, lineno, run_python


def test_a_code_a_name_or_a_bare_ignore_silences_that_line_only() -> None:
    x = torch.ones(2)
    with findings() as got:
        for _ in range(2):
            x.double()  # safetorch: ignore[ST001]
            x.float()  # safetorch: ignore[discarded-conversion]
            x.half()  # safetorch: ignore
            x.int()  # safetorch: ignore[ST004, ST007]
            line = lineno() - 1
            x.long()
            other = lineno() - 1
    assert [(w.category, w.lineno) for w in got] == [(DiscardedConversionWarning, line),
                                                     (DiscardedConversionWarning, other)]
    assert [s.lineno for s in _report.findings()] == [line, other]  # the summary leaves them out too


def test_strict_mode_does_not_raise_on_a_silenced_line() -> None:
    safetorch.install(strict=True)
    x = torch.ones(2)
    x.double()  # safetorch: ignore[ST001]


def test_a_silenced_eval_site_keeps_its_graph() -> None:
    model = nn.Linear(2, 2).eval()
    with findings() as got:
        outs = [model(torch.ones(1, 2)) for _ in range(3)]  # safetorch: ignore[ST003]
    assert got == [] and all(o.requires_grad for o in outs)


def test_the_summary_and_the_json_leave_silenced_lines_out(tmp_path: Any) -> None:
    script = os.path.join(str(tmp_path), "prog.py")
    report = os.path.join(str(tmp_path), "r.json")
    with open(script, "w") as fh:
        fh.write(textwrap.dedent("""\
            import torch, safetorch
            x = torch.ones(2)
            x.double()  # safetorch: ignore[ST001]
            x.float()
            """))
    proc = run_python(f"import runpy; runpy.run_path({script!r}, run_name='__main__')",
                      env={"SAFETORCH_REPORT": report})
    assert proc.returncode == 0, proc.stderr
    assert "safetorch: 1 finding(s) at 1 occurrence(s)" in proc.stderr and ":3" not in proc.stderr
    with open(report) as fh:
        assert [d["line"] for d in json.load(fh)] == [4]
