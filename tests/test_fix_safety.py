"""``safetorch fix`` never writes a program that is broken or does something else: the look-alike shapes (each fixed
right or skipped with its reason), files in other encodings and files that cannot be written, reports that no longer
match their files, ``--write``'s verification, and the corpus: every example and every rule page's bad snippet,
fixed with ``fix --write`` and run again."""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from safetorch import _fix, _fixio

from .conftest import ROOT, clean_env
from .test_fix import _fixed, _report_file, _run_here

pytest.importorskip("libcst")

SPANS = sys.version_info >= (3, 11)  # bytecode positions: the finding's exact expression
needs_spans = pytest.mark.skipif(not SPANS, reason="no bytecode positions before Python 3.11")


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "safetorch", "fix", *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


def _python(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in clean_env().items() if not k.startswith("SAFETORCH_")}
    return subprocess.run([sys.executable, script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# --- the exact expression ------------------------------------------------------------------------------------------


@needs_spans
def test_a_conversion_after_another_call_on_its_line_is_the_one_rewritten(tmp_path: Path) -> None:
    source, new, p = _fixed(tmp_path, """\
        import sys
        import torch
        x = torch.ones(2)
        sys.stdout.flush(); x.double()
        print(x.dtype)
        """, "ST001")
    assert new == source.replace("sys.stdout.flush(); x.double()", "sys.stdout.flush(); x = x.double()")
    assert [e.what for e in p.edits] == ["x = x.double()"]


@needs_spans
def test_the_accumulation_named_is_the_second_statement_of_its_line(tmp_path: Path) -> None:
    source, new, p = _fixed(tmp_path, """\
        import torch
        w = torch.ones(3, requires_grad=True)
        n, total = 0, 0.0
        for _ in range(3):
            loss = (w * 2).sum()
            loss.backward()
            n += 1; total += loss
        print(n, float(total))
        """, "ST004")
    assert new == source.replace("n += 1; total += loss", "n += 1; total += loss.item()")
    finding = p.edits[0].finding
    assert finding.message.startswith("ST004 total += loss adds a tensor") and finding.source == "total += loss"


def test_without_a_column_a_line_of_two_candidates_is_skipped_and_one_of_one_is_fixed(tmp_path: Path) -> None:
    """Python 3.10 has no bytecode positions (and an older report no columns): the line's only candidate is the
    finding's; a line of two is left alone, with the reason."""
    path = tmp_path / "prog.py"
    path.write_text("import torch\nx = y = torch.ones(2)\nx.double(); y.double()\nx.float()\n")
    message = "ST001 x.double() returns a copy and its result is discarded; x is unchanged. Write: x = x.double()"
    two = _fix.Finding("ST001", str(path), 3, message)
    one = _fix.Finding("ST001", str(path), 4, message.replace("double", "float"))
    p = _fix.plan([two, one])
    assert p.patched()[str(path)] == "import torch\nx = y = torch.ones(2)\nx.double(); y.double()\nx = x.float()\n"
    assert [s.why for s in p.skips] == [
        "the line holds 2 of them (a discarded conversion that is a statement of its own) and the finding does not "
        "say which (no column: Python 3.10, or a report without one): fix it by hand"]


@needs_spans
def test_a_report_whose_line_now_holds_another_call_is_skipped_not_rewritten(tmp_path: Path) -> None:
    program = textwrap.dedent("""\
        import torch
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(2)
        x.double()
        print(x.dtype)
        """)
    path = tmp_path / "prog.py"
    path.write_text(program)
    report = _report_file(tmp_path, _run_here(path))
    assert json.loads(Path(report).read_text())[0]["source"] == "x.double()"
    edited = program.replace("x = torch.ones(2)\n", "x = torch.ones(2)\nopt.zero_grad()\n")
    path.write_text(edited)
    result = _cli(["--write", "--no-verify", "--from", report], tmp_path)
    assert result.returncode == 0, result.stderr
    assert path.read_text() == edited  # `opt.zero_grad()` is not `opt = opt.zero_grad()`
    assert "skipped: prog.py:5: ST001 the file changed since the run: line 5 no longer holds `x.double()` there: " \
           "run again" in result.stderr


def test_the_json_report_places_the_expression_and_quotes_it(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text("import torch\nx = torch.ones(2)\nprint(1); x.double()\n")
    env = clean_env()
    proc = subprocess.run([sys.executable, "-m", "safetorch", "--exit-zero", "--report", "r.json", "prog.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [entry] = json.loads((tmp_path / "r.json").read_text())
    assert (entry["rule"], entry["code"], entry["line"], entry["abspath"], entry["file"]) == (
        "ST001", "ST001", 3, str(tmp_path / "prog.py"), entry["path"])  # the first version's fields are all there
    if SPANS:
        assert (entry["col"], entry["end_line"], entry["end_col"], entry["source"]) == (10, 3, 20, "x.double()")
    else:
        assert (entry["col"], entry["end_line"], entry["end_col"], entry["source"]) == (None, None, None, None)


# --- only as wide as the run proved --------------------------------------------------------------------------------


HELPER_TRAINS = """\
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)


    def train_one_epoch():
        model.train()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


    for epoch in range(3):
        train_one_epoch()
        model.eval()
        score = model(x).sum()
        print(round(float(score), 4))
        for i in range(2):
            out = model(x + i)
            print(round(float(out.sum()), 4))
"""


def test_an_epoch_loop_that_trains_through_a_helper_is_never_put_under_no_grad(tmp_path: Path) -> None:
    """No `.backward(` in the epoch loop's text, but the run saw a backward called from its line
    `train_one_epoch()`: only the evaluation statement and the evaluation loop go under no_grad."""
    source, new, p = _fixed(tmp_path, HELPER_TRAINS, "ST003")
    assert new == source.replace(
        "    score = model(x).sum()\n", "    with torch.no_grad():\n        score = model(x).sum()\n").replace(
        "    for i in range(2):\n"
        "        out = model(x + i)\n"
        "        print(round(float(out.sum()), 4))\n",
        "    with torch.no_grad():\n"
        "        for i in range(2):\n"
        "            out = model(x + i)\n"
        "            print(round(float(out.sum()), 4))\n")
    (tmp_path / "fixed.py").write_text(new)
    before, after = _python("prog.py", tmp_path), _python("fixed.py", tmp_path)
    assert after.returncode == 0, after.stderr
    assert after.stdout == before.stdout


def test_without_the_runs_record_only_the_forwards_statement_goes_under_no_grad(tmp_path: Path) -> None:
    """A report says nothing of what ran: the loop around the evaluation is not proven to train nothing."""
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(HELPER_TRAINS))
    found = [f for f in _run_here(path) if f.code == "ST003"]
    p = _fix.plan(found)
    assert sorted(e.what for e in p.edits) == ["the evaluation under `with torch.no_grad():`"] * 2


def test_a_property_and_an_item_of_a_tuple_take_no_assignment(tmp_path: Path) -> None:
    _, new, p = _fixed(tmp_path, """\
        import torch

        class Holder:
            def __init__(self):
                self._t = torch.ones(2)
                self.pair = (torch.ones(2), torch.zeros(2))

            @property
            def t(self):
                return self._t

        h = Holder()
        h.t.double()
        h.pair[0].double()
        """, "ST001")
    assert p.edits == []
    assert [s.finding.line for s in p.skips] == [13, 14]
    assert all("cannot take an assignment" in s.why for s in p.skips)


# --- ST005 keeps what volatile=True meant ------------------------------------------------------------------------


def test_volatile_becomes_no_grad_around_the_uses_of_what_it_made(tmp_path: Path) -> None:
    source, new, p = _fixed(tmp_path, """\
        import torch
        from torch.autograd import Variable
        model = torch.nn.Linear(4, 2).eval()
        x = torch.ones(3, 4)
        v = Variable(x, volatile=True)
        out = model(v)
        score = out.sum()
        print(round(float(score), 4))
        print("done")
        """, "ST005")
    assert new == source.replace(
        "v = Variable(x, volatile=True)\nout = model(v)\nscore = out.sum()\nprint(round(float(score), 4))\n",
        "with torch.no_grad():\n    v = Variable(x)\n    out = model(v)\n    score = out.sum()\n"
        "    print(round(float(score), 4))\n")
    assert sorted(e.what for e in p.edits) == ["its uses (lines 5-8) under `with torch.no_grad():`",
                                               "volatile= dropped"]


def test_volatile_whose_uses_train_is_skipped_with_the_reason(tmp_path: Path) -> None:
    _, new, p = _fixed(tmp_path, """\
        import torch
        from torch.autograd import Variable
        w = torch.ones(4, requires_grad=True)
        v = Variable(torch.ones(4), volatile=True)
        loss = (v * w).sum()
        loss.backward()
        """, "ST005")
    assert p.edits == []
    assert [s.why for s in p.skips] == ["volatile= is to become `with torch.no_grad():` around its uses, but a "
                                        "backward ran from lines 4-6: do it by hand"]


# --- what it says ----------------------------------------------------------------------------------------------


def test_lines_that_never_ran_and_rules_without_a_fix_are_listed_by_their_code(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(textwrap.dedent("""\
        import torch
        import torch.nn as nn
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.step()
        if torch.ones(1).sum() > 5:
            criterion = nn.MSELoss(size_average=False)
        """))
    result = _cli(["prog.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "not fixed: prog.py:5: ST010 has no mechanical fix (safetorch explain ST010)" in result.stderr
    assert "not fixed: never ran: prog.py:7: ST002? `criterion = nn.MSELoss(size_average=False)` (the run never " \
           "reached this line: run what reaches it to know)" in result.stderr
    assert "CODE" not in result.stderr


# --- safe writes -----------------------------------------------------------------------------------------------


def test_a_latin_1_file_with_a_bom_free_cookie_and_a_utf8_bom_file_are_written_in_their_encoding(
        tmp_path: Path) -> None:
    latin = b"# -*- coding: latin-1 -*-\r\nimport torch\r\nx = torch.ones(2)\r\nx.double()  # caf\xe9\r\n" \
            b"print('d\xe9j\xe0', x.dtype)\r\n"
    (tmp_path / "latin.py").write_bytes(latin)
    result = _cli(["--write", "latin.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "latin.py").read_bytes() == latin.replace(b"\nx.double()", b"\nx = x.double()")
    bom = "\ufeffimport torch\nx = torch.ones(2)\nx.double()  # é\n".encode()
    (tmp_path / "bom.py").write_bytes(bom)
    result = _cli(["--write", "--no-verify", "bom.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "bom.py").read_bytes() == bom.replace(b"\nx.double()", b"\nx = x.double()")


def test_one_file_that_cannot_be_written_leaves_every_file_unchanged_and_says_so(tmp_path: Path) -> None:
    helper = "import torch\nx = torch.ones(2)\nx.double()\n"
    main = "import torch\nimport helper\ny = torch.ones(2)\ny.double()\nprint(y.dtype)\n"
    (tmp_path / "helper.py").write_text(helper)
    (tmp_path / "main.py").write_text(main)
    os.chmod(tmp_path / "helper.py", 0o444)
    try:
        result = _cli(["--write", "main.py"], tmp_path)
    finally:
        os.chmod(tmp_path / "helper.py", 0o644)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "safetorch fix: nothing was written: helper.py: the file is not writable (mode 0444)" in result.stderr
    assert "unchanged: helper.py" in result.stderr and "unchanged: main.py" in result.stderr
    assert (tmp_path / "helper.py").read_text() == helper and (tmp_path / "main.py").read_text() == main
    assert sorted(os.listdir(tmp_path)) == ["helper.py", "main.py"]  # no temporary left


def test_a_file_that_changed_after_it_was_read_stops_the_write_of_all(tmp_path: Path) -> None:
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("a = 1\n")
    second.write_text("b = 1\n")
    read_a, read_b = _fixio.read(str(first)), _fixio.read(str(second))
    second.write_text("b = 2\n")
    with pytest.raises(_fixio.WriteError, match="the file changed since the run read it"):
        _fixio.write_all({str(first): (read_a, "a = 10\n"), str(second): (read_b, "b = 10\n")})
    assert first.read_text() == "a = 1\n" and second.read_text() == "b = 2\n"


def test_write_verifies_unless_told_not_to_and_a_report_needs_the_script_for_it(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text("import torch\nx = torch.ones(2)\nx.double()\nprint(x.dtype)\n")
    written = _cli(["--write", "prog.py"], tmp_path)
    assert written.returncode == 0, written.stderr
    assert "fixed: prog.py:3: ST001 x = x.double() (verified)" in written.stderr
    report = _report_file(tmp_path, [])
    refused = _cli(["--write", "--from", report], tmp_path)
    assert refused.returncode == 2
    assert "--write verifies the fixes by running the program again" in refused.stderr


# --- the corpus ----------------------------------------------------------------------------------------------------

#: For each fixable rule's page: which ```python block holds a bad snippet that runs on a CPU, and what the snippet
#: needs defined first.
PAGES: dict[str, tuple[int, str]] = {
    "ST001": (2, "x = torch.randn(4, 2, 3)"),
    "ST002": (1, "x = torch.randn(8, 3).log_softmax(1)\nt = torch.randint(0, 3, (8,))"),
    "ST003": (1, "model = nn.Linear(4, 3)\nval_loader = [(torch.randn(8, 4), torch.zeros(8)) for _ in range(3)]"),
    "ST004": (1, "model = nn.Linear(4, 3)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                 "criterion = nn.CrossEntropyLoss()\n"
                 "loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]"),
    "ST005": (1, "from torch.autograd import Variable\ninput = torch.randn(8, 4)"),
    "ST009": (1, "model = nn.Linear(4, 3)\nx = torch.randn(8, 4)\ny = torch.randint(0, 3, (8,))\n"
                 "logits = torch.randn(8, 3, requires_grad=True)\nz = torch.randn(8, requires_grad=True)\n"
                 "t = torch.rand(8)"),
    "ST013": (1, ""),
    "ST014": (1, "model = nn.Linear(2, 2)\n"
                 "torch.save({f'module.{k}': v * 0 for k, v in model.state_dict().items()}, 'ddp_model.pt')"),
    "ST015": (1, "backbone, head = nn.Linear(4, 4), nn.Linear(4, 2)\nmodel = nn.Sequential(backbone, head)"),
}

#: The fixes whose point is to change what the program does: a copy kept (a new dtype, device or shape), the logits
#: passed on, dropout off in eval mode, the checkpoint's weights loaded, the backbone frozen. Only a verifying run
#: (``--write``'s default) tells whether the rest of the program agrees; the other fixes keep what it prints.
INTENDED_CHANGES = frozenset({"ST001", "ST009", "ST013", "ST014", "ST015"})

_POSTLUDE = """
for _name, _value in sorted(globals().items()):
    if isinstance(_value, torch.Tensor) and _value.dim() == 0:  # a sum kept as a number or as a tensor: the same
        print(_name, round(float(_value), 4))
    elif isinstance(_value, torch.Tensor):
        print(_name, tuple(_value.shape), _value.dtype, round(float(_value.detach().double().sum()), 4))
    elif isinstance(_value, float):
        print(_name, round(_value, 4))
    elif isinstance(_value, nn.Module):
        print(_name, [(n, p.requires_grad, round(float(p.detach().sum()), 4)) for n, p in _value.named_parameters()])
"""

_PRELUDE = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\ntorch.manual_seed(0)\n"


def bad_snippet(page: str, block: int) -> str:
    """The bad code of a rule page's ``block``-th python block: the lines marked ``# what to write`` go, with the lines
    indented under them (the good code's body)."""
    code = re.findall(r"```python\n(.*?)```", page, re.S)[block - 1]
    kept: list[str] = []
    under: int | None = None
    for line in code.splitlines():
        indent = len(line) - len(line.lstrip())
        if under is not None and line.strip() and indent > under:
            continue
        under = None
        if "what to write" in line:
            under = indent
            continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def _corpus_program(code: str) -> str:
    block, needs = PAGES[code]
    with open(os.path.join(ROOT, "docs", "rules", f"{code}.md"), encoding="utf-8") as fh:
        snippet = bad_snippet(fh.read(), block)
    if code == "ST013":  # the page's class, made and called in eval mode
        snippet = snippet.replace("class Net(nn.Module):\n", "class Net(nn.Module):\n    def __init__(self):\n"
                                  "        super().__init__()\n        self.fc = nn.Linear(4, 4)\n\n")
        snippet += "\nnet = Net().eval()\nprint(net(torch.ones(2, 4)).shape)\n"
    if code == "ST015":
        snippet += "print([p.requires_grad for p in model.parameters()])\n"
    return _PRELUDE + needs + "\n" + snippet + _POSTLUDE


def _run_in_process(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[_fix.Finding], Any, str, bool]:
    """(what it found, what ran, what it printed, whether it ran to its end), run here with every check on."""
    from safetorch import _fixtrace, _formats, _report

    from .conftest import findings

    capsys.readouterr()
    _report.reset()
    ok = True
    with findings(), _fixtrace.recording() as ran:
        try:
            runpy.run_path(str(path), run_name="__main__")
        except BaseException:  # noqa: BLE001  (the program's own failure: what it found stands)
            ok = False
    entries = [{"code": f.code, "file": f.filename, "line": f.lineno, "message": f.message,
                **_formats._span({"line": f.lineno, "span": f.span, "source": f.source})} for f in _report.findings()]
    _report.reset()
    return _fix.findings_from(entries), ran, capsys.readouterr().out, ok


def _fixed_unverified_and_run(tmp_path: Path, script: str, capsys: pytest.CaptureFixture[str]) -> _fix.Plan:
    """The fixes of one run written without a verifying run (``--write --no-verify``): the program still parses; with
    no fix whose point is to change what it does, it still runs and prints the same; its fixable findings are gone,
    or were skipped with a reason."""
    path = tmp_path / script
    found, ran, before, ran_through = _run_in_process(path, capsys)
    p = _fix.plan(found, ran)
    _fixio.write_all({k: (p.files[k], text) for k, text in p.patched().items() if text != p.sources[k]})
    compile(path.read_text(), str(path), "exec")
    left, _, after, still_runs = _run_in_process(path, capsys)
    if not {e.finding.code for e in p.edits} & INTENDED_CHANGES and ran_through:
        assert still_runs and after == before, path.read_text()
        skipped = {(s.finding.code, s.finding.line) for s in p.skips}
        for f in left:
            assert not _fix.fixable(f.code) or (f.code, f.line) in skipped, (f, p.skips, path.read_text())
    return p


@pytest.mark.parametrize("code", sorted(PAGES))
def test_each_rule_pages_bad_snippet_fixed_unverified_and_run(tmp_path: Path, code: str,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snippet.py").write_text(_corpus_program(code))
    p = _fixed_unverified_and_run(tmp_path, "snippet.py", capsys)
    assert code in {e.finding.code for e in p.edits} | {s.finding.code for s in p.skips}


EXAMPLES = sorted(n for n in os.listdir(os.path.join(ROOT, "examples")) if n.endswith(".py"))
#: The examples whose output the fixes change (a conversion kept, the logits passed on: the fixes' point).
CHANGES_OUTPUT = {"seed_posts.py", "softmax_into_cross_entropy.py", "demo.py"}


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_fixed_unverified_and_run(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copy(os.path.join(ROOT, "examples", name), tmp_path / name)
    _fixed_unverified_and_run(tmp_path, name, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["demo.py", "seed_posts.py"])  # every rule's fix; each example in-process above
def test_each_example_fixed_with_write_and_run(tmp_path: Path, name: str) -> None:
    """The command itself, ``fix --write`` (verified, in rounds), then the program under the runner."""
    shutil.copy(os.path.join(ROOT, "examples", name), tmp_path / name)
    before = _python(name, tmp_path) if name not in CHANGES_OUTPUT else None
    fixed = _cli(["--write", name], tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert not re.search(r"File \".*safetorch[/\\]_fix", fixed.stderr) and "CODE" not in fixed.stderr
    after = subprocess.run([sys.executable, "-m", "safetorch", "--exit-zero", "--report", "again.json", name],
                           cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert after.returncode == 0, (fixed.stderr, after.stderr)
    if before is not None:
        assert after.stdout == before.stdout, fixed.stderr
    for code in {e["rule"] for e in json.loads((tmp_path / "again.json").read_text()) if _fix.fixable(e["rule"])}:
        assert re.search(rf"^(skipped|not fixed): \S+: {code} ", fixed.stderr, re.M), (code, fixed.stderr)


def test_the_corpus_takes_every_fixable_rule_and_the_pages_mark_their_bad_lines() -> None:
    assert sorted(PAGES) == sorted(_fix.FIXABLE)
    program = _corpus_program("ST003")
    assert "    score = model(x)          # ST003" in program and "with torch.no_grad()" not in program


def test_without_positions_the_st004_message_names_the_lines_only_accumulation_or_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.10 reads no expression from the bytecode: the line's only accumulation is named, and a line of two
    names none (no guessed `total += loss` for `n += 1; total += loss`)."""
    import torch

    from safetorch.checks import graph_accumulation

    monkeypatch.setattr(graph_accumulation, "call_source", lambda frame: None)
    loss = torch.ones(2, requires_grad=True).sum()
    n, total, frame = 0, 0.0, sys._getframe()
    n = 1; total += n; one = graph_accumulation._message(frame, loss.numel())  # noqa: E702
    n += 1; total += n; two = graph_accumulation._message(frame, loss.numel())  # noqa: E702
    assert one[0].startswith("ST004 total += n adds a tensor") and one[1] == "Write: total += n.item()"
    assert two[0].startswith("ST004 an accumulation at this line adds") and "total" not in " ".join(two)
    assert (n, total) == (2, 3.0)
