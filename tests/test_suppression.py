"""``# safetorch: ignore[ST001]`` (or ``# noqa: ST001``) silences that rule on that statement only: on any of its lines,
or alone on the line directly above it, as ruff reads its comments."""

from __future__ import annotations

import inspect
import json
import linecache
import os
import textwrap
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import DiscardedConversionWarning, EvalModeGradWarning, SafetorchConfigWarning, _report, _suppress

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


# --- where the comment may stand: any line of the statement, or alone on the line above ---------------------------


def test_a_comment_on_the_first_middle_or_closing_line_of_a_call_silences_it() -> None:
    x = torch.ones(2)
    with findings() as got:
        x.to(  # safetorch: ignore[ST001]
            torch.float64,
        )
        x.to(
            torch.float64,  # safetorch: ignore[ST001]
        )
        x.to(
            torch.float64,
        )  # safetorch: ignore[ST001]
        x.to(
            torch.float64,
        ); line = lineno() - 2  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(DiscardedConversionWarning, __file__, line)]


def test_a_formatted_forward_keeps_its_graph_with_the_comment_on_its_closing_line() -> None:
    """black and ruff-format move a call's trailing comment to its closing line: ST003 still leaves it alone."""
    model = nn.Linear(2, 2).eval()
    with findings() as got:
        for _ in range(3):
            y = model(
                torch.ones(1, 2),
            )  # safetorch: ignore[ST003]
            assert y.requires_grad
        for _ in range(3):
            model(
                torch.ones(1, 2),
            ); line = lineno() - 2  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(EvalModeGradWarning, line)]


def test_a_line_reported_inside_a_statement_is_silenced_by_its_first_or_last_line() -> None:
    """The reported line is the call's own (``model(x)`` inside a list, ``.double()`` on a continuation line): a
    comment on another line of the same statement still counts."""
    model = nn.Linear(2, 2).eval()
    x = torch.ones(1, 2)
    with findings() as got:
        for _ in range(3):
            torch.cat([
                model(x),
                x,
            ])  # safetorch: ignore[ST003]
            (x  # safetorch: ignore[ST001]
             .double())
    assert got == []


def test_a_comment_alone_on_the_line_directly_above_silences_the_statement() -> None:
    x = torch.ones(2)
    model = nn.Linear(2, 2).eval()
    with findings() as got:
        for _ in range(3):
            # safetorch: ignore[ST001]
            x.double()
            # safetorch: ignore[eval-mode-grad]
            model(
                x[None],
            )
    assert got == []


def test_a_comment_above_a_blank_line_does_not_reach_the_statement() -> None:
    """Only the line directly above: a comment above a blank line speaks of what follows as a block."""
    x = torch.ones(2)
    with findings() as got:
        # safetorch: ignore[ST001]

        x.double(); line = lineno()  # noqa: E702
    assert [w.lineno for w in got] == [line]


def test_a_comment_on_a_neighbouring_statement_does_not_silence() -> None:
    x = torch.ones(2)
    with findings() as got:
        a = 1  # safetorch: ignore[ST001]
        x.double(); first = lineno()  # noqa: E702
        x.float(); second = lineno()  # noqa: E702
        b = 2  # safetorch: ignore[ST001]
        for _ in range(1):  # safetorch: ignore[ST001]
            x.half(); third = lineno()  # noqa: E702
    assert (a, b) == (1, 2)
    assert [w.lineno for w in got] == [first, second, third]


def test_text_in_a_string_is_not_a_comment() -> None:
    x = torch.ones(2)
    with findings() as got:
        x.to("# safetorch: ignore[ST001]" and torch.float64); first = lineno()  # noqa: E702
        s = "# safetorch: ignore[ST001]"
        x.double(); second = lineno()  # noqa: E702
    assert s and [w.lineno for w in got] == [first, second]


def test_strict_mode_does_not_raise_where_a_comment_silences_the_statement() -> None:
    safetorch.install(strict=True)
    x = torch.ones(2)
    model = nn.Linear(2, 2).eval()
    x.to(
        torch.float64,
    )  # safetorch: ignore[ST001]
    # safetorch: ignore[ST001]
    x.double()
    x.half()  # noqa: ST001
    for _ in range(3):
        model(
            x[None],
        )  # noqa: ST003
    with pytest.raises(safetorch.SafetorchError):
        x.int()  # noqa


# --- noqa comments: codes only --------------------------------------------------------------------------------------


def test_noqa_with_our_code_is_honoured_and_a_bare_noqa_is_not() -> None:
    x = torch.ones(2)
    with findings() as got:
        x.double()  # noqa: ST001
        x.float()  # noqa: E501, ST001
        x.half()  # noqa:ST004,ST001
        # noqa: ST001
        x.long()
        x.int()  # noqa
        bare = lineno() - 1
        x.bool()  # noqa: E501
        other = lineno() - 1
    assert [w.lineno for w in got] == [bare, other]


# --- a code that names no rule ---------------------------------------------------------------------------------------


def test_a_code_that_names_no_rule_warns_at_its_line_once() -> None:
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x.double()  # safetorch: ignore[ST01, discarded-conversion]
            typo = lineno() - 1
            x.float()  # safetorch: ignore[no-such-rule]
            unknown = lineno() - 1
            x.half()  # noqa: E501, ST03
            noqa = lineno() - 1
    config = [w for w in caught if w.category is SafetorchConfigWarning]
    assert [(w.filename, w.lineno) for w in config] == [(__file__, typo), (__file__, unknown), (__file__, noqa)]
    assert "'ST01'" in str(config[0].message) and "ST001 (discarded-conversion)" in str(config[0].message)
    assert "'no-such-rule'" in str(config[1].message) and "'ST03'" in str(config[2].message)
    assert "E501" not in str(config[2].message).split("names no rule")[1].split("Valid")[0]
    shown = [w.lineno for w in caught if w.category is DiscardedConversionWarning]
    assert shown == [unknown, noqa]  # ST01 named nothing, but the comment's valid name still silences its line


def test_a_comment_above_that_names_no_rule_warns_at_the_comment() -> None:
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # safetorch: ignore[ST0001]
        x.double(); line = lineno() - 1  # noqa: E702
    assert [(w.filename, w.lineno) for w in caught if w.category is SafetorchConfigWarning] == [(__file__, line)]


# --- the source, read from linecache ---------------------------------------------------------------------------------


def _run_source(compiled: str, shown: list[str], filename: str) -> list[int]:
    """Run ``compiled`` under ``filename`` while linecache holds ``shown`` for it (an edited file, a cell)."""
    linecache.cache[filename] = (sum(map(len, shown)), None, shown, filename)
    with findings() as got:
        exec(compile(compiled, filename, "exec"), {"x": torch.ones(2)})
    return [w.lineno for w in got]


def test_an_edited_file_is_read_again() -> None:
    """The answers are cached per version of the file's lines in linecache: a new version is read afresh."""
    code = "x.double()\n"
    assert _run_source(code, ["x.double()  # safetorch: ignore[ST001]\n"], "<edited>") == []
    _report.reset()
    assert _run_source(code, ["x.double()\n"], "<edited>") == [1]
    assert not _suppress.suppressed("ST001", "<edited>", 1)


def test_a_source_that_no_longer_tokenizes_still_has_its_line_comments() -> None:
    shown = ["y = (\n", "x.double()  # safetorch: ignore[ST001]\n", "x.float()\n"]
    assert _run_source("pass\nx.double()\nx.float()\n", shown, "<no longer tokenizes>") == [3]
