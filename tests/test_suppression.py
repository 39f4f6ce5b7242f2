"""``# safetorch: ignore[ST001]`` on a line silences that rule on that line only, as ``# noqa`` does for linters."""

from __future__ import annotations

import inspect
import json
import linecache
import os
import textwrap
from typing import Any

import pytest
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


@pytest.mark.parametrize("code", sorted(safetorch.RULES))
def test_every_rule_is_silenced_on_the_line_it_reports(code: str) -> None:
    """Each rule's pitfall (from test_raise_path), run once to find the line it reports, then again with
    `# safetorch: ignore[<code>]` on that line: silent, and nothing in the summary."""
    from . import test_raise_path

    pitfall = test_raise_path.PITFALLS[code]
    category = safetorch.RULES[code].category
    source = textwrap.dedent(inspect.getsource(pitfall))
    scope = dict(vars(test_raise_path))

    def run(text: str, filename: str) -> list[Any]:
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        exec(compile(text, filename, "exec"), scope)
        with findings() as got:
            scope[pitfall.__name__]()
        return [w for w in got if w.category is category]

    reported = {w.lineno for w in run(source, f"<{code} pitfall>")}
    assert len(reported) == 1
    line = reported.pop()
    lines = source.splitlines(True)
    lines[line - 1] = lines[line - 1].rstrip("\n") + f"  # safetorch: ignore[{code}]\n"
    assert run("".join(lines), f"<{code} pitfall, silenced>") == []
    assert not any(s.filename == f"<{code} pitfall, silenced>" for s in _report.findings())
