"""``safetorch fix``: each fix from a run's finding, its exact diff, the file untouched elsewhere byte for byte, and the
re-run without the finding; skips with their reason; ``--check``/``--write`` as pre-commit runs them; ``--verify`` on
the seed posts' patterns."""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import safetorch
from safetorch import _fix, _fixtrace, _formats, _report

from .conftest import ROOT, clean_env, findings

pytest.importorskip("libcst")


def _run_here(path: Path, facts: list[_fixtrace.Facts] | None = None) -> list[_fix.Finding]:
    """Run the program in this process with every check on; what it found, as the JSON report gives it (and, into
    ``facts``, what ran, as ``safetorch fix``'s run records it)."""
    _report.reset()
    with findings(), _fixtrace.recording() as ran:
        try:
            runpy.run_path(str(path), run_name="__main__")
        except Exception:  # noqa: S110  (a program that fails still found what it found)
            pass
    if facts is not None:
        facts.append(ran)
    entries = [{"code": f.code, "file": f.filename, "line": f.lineno, "message": f.message,
                **_formats._span({"line": f.lineno, "span": f.span, "source": f.source})}
               for f in _report.findings()]
    _report.reset()
    return _fix.findings_from(entries)


def _fixed(tmp_path: Path, source: str, code: str, name: str = "prog.py") -> tuple[str, str, _fix.Plan]:
    """(the program's text, the text with every fix, the plan), after checking that the run found ``code``."""
    source = textwrap.dedent(source)
    path = tmp_path / name
    path.write_text(source)
    ran: list[_fixtrace.Facts] = []
    found = _run_here(path, ran)
    assert code in {f.code for f in found}, found
    p = _fix.plan(found, ran[0])
    return source, p.patched().get(str(path), source), p


def _rerun(tmp_path: Path, text: str) -> set[str]:
    path = tmp_path / "prog.py"
    path.write_text(text)
    return {f.code for f in _run_here(path)}


CASES: dict[str, tuple[str, str, str, str]] = {
    # code: (program, a line of it, what the line becomes, what the fix says)
    "ST001": ("""\
        import torch
        x = torch.ones(2, dtype=torch.float64)
        x.float()  # the conversion, kept: this comment stays
        print(x.dtype)
        """, "x.float()  # the conversion", "x = x.float()  # the conversion", "x = x.float()"),
    "ST002": ("""\
        import torch
        import torch.nn as nn
        criterion = nn.MSELoss(size_average=False, reduce=True)  # the sum
        print(criterion(torch.ones(3), torch.zeros(3)))
        """, "nn.MSELoss(size_average=False, reduce=True)", 'nn.MSELoss(reduction="sum")', 'reduction="sum"'),
    "ST004": ("""\
        import torch
        w = torch.ones(3, requires_grad=True)
        total = 0.0
        for _ in range(3):
            loss = (w * 2).sum()
            loss.backward()
            total += loss  # accumulated
        print(total)
        """, "    total += loss  # accumulated", "    total += loss.item()  # accumulated", "total += loss.item()"),
    "ST005": ("""\
        import torch
        from torch.autograd import Variable
        x = torch.ones(2)
        v = Variable(x, volatile=True)
        print(v)
        """, "v = Variable(x, volatile=True)\nprint(v)", "with torch.no_grad():\n    v = Variable(x)\n    print(v)",
        "volatile= dropped"),
    "ST009": ("""\
        import torch
        import torch.nn.functional as F
        logits = torch.randn(4, 3, requires_grad=True)
        y = torch.tensor([0, 1, 2, 0])
        loss = F.cross_entropy(F.softmax(logits, dim=1), y)
        loss.backward()
        """, "F.cross_entropy(F.softmax(logits, dim=1), y)", "F.cross_entropy(logits, y)", "the loss gets `logits`"),
    "ST013": ("""\
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(F.dropout(x, 0.5))

        net = Net().eval()
        net(torch.ones(1, 4))
        """, "F.dropout(x, 0.5))", "F.dropout(x, 0.5, training=self.training))", "training=self.training"),
    "ST014": ("""\
        import torch.nn as nn
        model = nn.Linear(2, 2)
        checkpoint = {f"module.{k}": v for k, v in model.state_dict().items()}
        model.load_state_dict(checkpoint, strict=False)
        """, "model.load_state_dict(checkpoint, strict=False)",
        "model.load_state_dict({k.removeprefix('module.'): v for k, v in checkpoint.items()}, strict=False)",
        "keys without 'module.'"),
    "ST015": ("""\
        import torch
        import torch.nn as nn
        backbone, head = nn.Linear(4, 4), nn.Linear(4, 2)
        backbone.requires_grad = False  # freeze it
        for p in head.parameters():
            p.require_grad = False
        optimizer = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.1)
        """, "backbone.requires_grad = False  # freeze it\nfor p in head.parameters():\n    p.require_grad = False",
        "backbone.requires_grad_(False)  # freeze it\nfor p in head.parameters():\n    p.requires_grad = False",
        "backbone.requires_grad_(False)"),
}


@pytest.mark.parametrize("code", sorted(CASES))
def test_each_fix_rewrites_only_its_line_and_the_rerun_no_longer_finds_it(tmp_path: Path, code: str) -> None:
    program, bad, good, what = CASES[code]
    source, new, p = _fixed(tmp_path, program, code)
    assert textwrap.dedent(bad) in source
    assert new == source.replace(textwrap.dedent(bad), textwrap.dedent(good), 1)  # everything else byte for byte
    assert what in [e.what for e in p.edits if e.finding.code == code]
    assert code not in _rerun(tmp_path, new)


def test_the_diff_is_a_unified_diff_of_the_changed_lines_only(tmp_path: Path) -> None:
    _, _, p = _fixed(tmp_path, CASES["ST001"][0], "ST001")
    assert p.diff(root=str(tmp_path)) == (
        "--- a/prog.py\n"
        "+++ b/prog.py\n"
        "@@ -1,4 +1,4 @@\n"
        " import torch\n"
        " x = torch.ones(2, dtype=torch.float64)\n"
        "-x.float()  # the conversion, kept: this comment stays\n"
        "+x = x.float()  # the conversion, kept: this comment stays\n"
        " print(x.dtype)\n")


EVALUATION = """\
    import torch
    import torch.nn as nn

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for epoch in range(3):
        model.train()
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        model.eval()
        score = model(x).sum()  # validation, in the training loop
        # the test set
        for i in range(3):
            out = model(x + i)
            print(float(out.sum()))
"""


def test_st003_puts_the_evaluation_loop_under_no_grad_and_a_lone_evaluation_in_a_training_loop(
        tmp_path: Path) -> None:
    source, new, p = _fixed(tmp_path, EVALUATION, "ST003")
    assert new == source.replace(
        "    score = model(x).sum()  # validation, in the training loop\n"
        "    # the test set\n"
        "    for i in range(3):\n"
        "        out = model(x + i)\n"
        "        print(float(out.sum()))\n",
        "    with torch.no_grad():\n"
        "        score = model(x).sum()  # validation, in the training loop\n"
        "    # the test set\n"
        "    with torch.no_grad():\n"
        "        for i in range(3):\n"
        "            out = model(x + i)\n"
        "            print(float(out.sum()))\n")
    assert sorted(e.what for e in p.edits) == ["the evaluation loop under `with torch.no_grad():`",
                                               "the evaluation under `with torch.no_grad():`"]
    assert "ST003" not in _rerun(tmp_path, new)


def test_st004_a_list_of_losses_keeps_their_numbers(tmp_path: Path) -> None:
    program = """\
        import torch
        w = torch.ones(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        losses = []
        for _ in range(3):
            loss = (w * 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss)  # the history
        print(len(losses))
        """
    source, new, _ = _fixed(tmp_path, program, "ST004")
    assert new == source.replace("losses.append(loss)  # the history", "losses.append(loss.item())  # the history")
    assert "ST004" not in _rerun(tmp_path, new)


@pytest.mark.parametrize(("sums", "fixed"), [("total += loss", "total += loss.item()"),
                                              ("total = total + loss", "total = total + loss.item()"),
                                              ("total = loss + total", "total = loss.item() + total")])
def test_st004_a_tensor_accumulator_is_fixed_in_place_or_rebound(tmp_path: Path, sums: str, fixed: str) -> None:
    program = f"""\
        import torch
        w = torch.ones(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        total = torch.zeros(())
        for _ in range(3):
            loss = (w * 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            {sums}  # the running sum
        print(float(total))
        """
    source, new, _ = _fixed(tmp_path, program, "ST004")
    assert new == source.replace(f"{sums}  # the running sum", f"{fixed}  # the running sum")
    assert "ST004" not in _rerun(tmp_path, new)


SKIPPED = {
    "ST001": ("""\
        import torch
        lin = torch.nn.Linear(2, 2)
        lin.weight.double()
        """, "`lin.weight` cannot take an assignment (a module's parameter, a property, an item of a tensor or a "
             "tuple, or a value the run could not read): assign the result to a name by hand"),
    "ST003": ("""\
        import torch
        import torch.nn as nn
        model = nn.Linear(4, 2).eval()

        def predict(x):
            return model(x)

        for i in range(3):
            print(float(predict(torch.ones(1, 4)).sum()))
        """, "the forward's result is returned: its callers may train through it"),
    "ST009": ("""\
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        net = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1))
        F.cross_entropy(net(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
        """, "the probabilities reach the loss through an expression: pass the logits there by hand"),
}


@pytest.mark.parametrize("code", sorted(SKIPPED))
def test_what_the_run_does_not_make_certain_is_skipped_with_its_reason(tmp_path: Path, code: str) -> None:
    program, why = SKIPPED[code]
    source, new, p = _fixed(tmp_path, program, code)
    assert new == source and p.edits == []
    assert [(s.finding.code, s.why) for s in p.skips] == [(code, why)]


def test_softmax_through_a_variable_just_above_passes_its_input(tmp_path: Path) -> None:
    program = """\
        import torch
        import torch.nn.functional as F
        logits = torch.randn(4, 3, requires_grad=True)
        y = torch.tensor([0, 1, 2, 0])
        probs = F.softmax(logits, dim=1)
        F.nll_loss(probs.log(), y)
        loss = F.cross_entropy(probs, y)
        loss.backward()
        """
    source, new, _ = _fixed(tmp_path, program, "ST009")
    assert new == source.replace("loss = F.cross_entropy(probs, y)", "loss = F.cross_entropy(logits, y)")
    assert "ST009" not in _rerun(tmp_path, new)


def test_softmax_into_nll_loss_becomes_log_softmax(tmp_path: Path) -> None:
    program = """\
        import torch
        import torch.nn.functional as F
        logits = torch.randn(4, 3, requires_grad=True)
        F.nll_loss(F.softmax(logits, dim=1), torch.tensor([0, 1, 2, 0])).backward()
        """
    source, new, _ = _fixed(tmp_path, program, "ST009")
    assert new == source.replace("F.softmax(logits, dim=1)", "F.log_softmax(logits, dim=1)")
    assert "ST009" not in _rerun(tmp_path, new)


def test_a_file_with_nothing_to_fix_is_untouched(tmp_path: Path) -> None:
    path = tmp_path / "prog.py"
    path.write_bytes(b"import torch\r\nx = torch.ones(2)\r\nx = x.float()  # fine\r\n")
    before = path.stat().st_mtime_ns
    found = _run_here(path)
    assert found == []
    assert _fix.main(["--write", "--no-verify", "--from", _report_file(tmp_path, [])]) == 0
    assert path.read_bytes() == b"import torch\r\nx = torch.ones(2)\r\nx = x.float()  # fine\r\n"
    assert path.stat().st_mtime_ns == before


def test_line_endings_and_the_rest_of_a_crlf_file_survive_a_fix(tmp_path: Path) -> None:
    path = tmp_path / "prog.py"
    path.write_bytes(b"import torch\r\nx = torch.ones(2, dtype=torch.float64)\r\nx.float()\r\nprint(x)\r\n")
    found = _run_here(path)
    assert _fix.main(["--write", "--no-verify", "--from", _report_file(tmp_path, found)]) == 0
    fixed = b"import torch\r\nx = torch.ones(2, dtype=torch.float64)\r\nx = x.float()\r\nprint(x)\r\n"
    assert path.read_bytes() == fixed


def _report_file(tmp_path: Path, found: list[_fix.Finding]) -> str:
    import json

    report = tmp_path / "findings.json"
    report.write_text(json.dumps([{"rule": f.code, "abspath": f.path, "line": f.line, "message": f.message,
                                   **_formats._span({"line": f.line, "span": f.span, "source": f.source})}
                                  for f in found]))
    return str(report)


def test_from_a_report_prints_the_diff_and_check_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, p = _fixed(tmp_path, CASES["ST001"][0], "ST001")
    found = [e.finding for e in p.edits]
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()  # the program's own output
    assert _fix.main(["--check", "--from", _report_file(tmp_path, found)]) == 1
    out, err = capsys.readouterr()
    assert out == p.diff(root=str(tmp_path))
    assert "fix: prog.py:3: ST001 x = x.float()" in err


def test_without_libcst_it_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "libcst", None)
    assert _fix.main(["prog.py"]) == 2
    assert "pip install 'safetorch[fix]'" in capsys.readouterr().err


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "safetorch", "fix", *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


def test_check_then_write_then_check_as_a_pre_commit_hook_runs_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(CASES["ST002"][0]))
    first = _cli(["--check", "train.py"], tmp_path)
    assert first.returncode == 1, first.stderr
    assert "+criterion = nn.MSELoss(reduction=\"sum\")  # the sum" in first.stdout
    written = _cli(["--write", "train.py"], tmp_path)
    assert written.returncode == 0 and written.stdout == "", written.stderr
    assert "fixed: train.py:3: ST002 reduction=\"sum\"" in written.stderr
    again = _cli(["--check", "train.py"], tmp_path)
    assert again.returncode == 0 and again.stdout == "", again.stderr
    assert "safetorch fix: nothing to fix" in again.stderr


def test_the_seed_posts_patterns_are_fixed_end_to_end_and_verified(tmp_path: Path) -> None:
    """The script crashes at its first forward (the discarded conversion): the first round fixes what that run saw,
    and each verifying run of the patched copy finds what the next round fixes."""
    shutil.copy(os.path.join(ROOT, "examples", "seed_posts.py"), tmp_path / "seed_posts.py")
    fixed = _cli(["--write", "--verify", "seed_posts.py"], tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    done = sorted(line.split(": ")[2].split()[0] for line in fixed.stderr.splitlines() if line.startswith("fixed: "))
    assert done == ["ST001", "ST002", "ST003", "ST004", "ST005"], fixed.stderr
    assert all(line.endswith("(verified)") for line in fixed.stderr.splitlines() if line.startswith("fixed: "))
    clean = subprocess.run([sys.executable, "-m", "safetorch", "seed_posts.py"], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr  # ran, and found nothing
    assert "Warning" not in clean.stderr and "validation loss" in clean.stdout


def test_verify_drops_a_fix_whose_patched_program_fails(tmp_path: Path) -> None:
    """``total += loss.item()`` is right, but the program then calls ``total.detach()``: the verified patch keeps
    the other fix only."""
    program = textwrap.dedent("""\
        import torch
        w = torch.ones(3, requires_grad=True)
        x = torch.ones(2, dtype=torch.float64)
        x.float()
        total = 0.0
        for _ in range(2):
            loss = (w * 2).sum()
            loss.backward()
            total += loss
        print(float(total.detach()))
        """)
    (tmp_path / "prog.py").write_text(program)
    result = _cli(["--verify", "prog.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "fix: prog.py:4: ST001 x = x.float() (verified)" in result.stderr
    assert "skipped: prog.py:9: ST004 not verified: total += loss.item()" in result.stderr
    assert "-x.float()\n+x = x.float()\n" in result.stdout and "loss.item()" not in result.stdout
    assert (tmp_path / "prog.py").read_text() == program  # no --write: nothing written


def test_every_rule_page_says_whether_fix_handles_it() -> None:
    for code in safetorch.RULES:
        with open(os.path.join(ROOT, "docs", "rules", f"{code}.md")) as fh:
            page = fh.read()
        expected = "`safetorch fix` rewrites it" if _fix.fixable(code) else "`safetorch fix` has no mechanical fix"
        assert expected in page, code


def test_a_softmax_module_and_a_dropout_module_on_the_fixed_line_are_told_apart(tmp_path: Path) -> None:
    program = """\
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self.softmax, self.dropout = nn.Linear(4, 3), nn.Softmax(dim=1), nn.Dropout(0.1)

            def forward(self, x):
                return self.dropout(F.dropout(self.fc(x), 0.2))

            def loss(self, x, y):
                return F.cross_entropy(self.softmax(self(x)), y)

        net = Net()
        net.loss(torch.randn(2, 4), torch.tensor([0, 1])).backward()
        net.eval()
        net(torch.randn(2, 4))
        """
    source, new, p = _fixed(tmp_path, program, "ST013")
    assert new == source.replace("self.dropout(F.dropout(self.fc(x), 0.2))",
                                 "self.dropout(F.dropout(self.fc(x), 0.2, training=self.training))").replace(
        "F.cross_entropy(self.softmax(self(x)), y)", "F.cross_entropy(self(x), y)")
    assert sorted(e.finding.code for e in p.edits) == ["ST009", "ST013"]


def test_a_finding_in_an_installed_library_is_never_rewritten(tmp_path: Path) -> None:
    library = tmp_path / "site-packages" / "lib.py"
    library.parent.mkdir()
    library.write_text("x.float()\n")
    p = _fix.plan([_fix.Finding("ST001", str(library), 1, "ST001 x.float() returns a copy")])
    assert p.edits == [] and [s.why for s in p.skips] == ["in an installed library, not the program's own code"]
    assert library.read_text() == "x.float()\n"
