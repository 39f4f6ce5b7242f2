"""The command line as CI and a terminal use it: subcommands, exit status, output formats, ``[tool.safetorch]``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import safetorch

from .conftest import ROOT
from .conftest import clean_env as _env
from .conftest import run_runner as _safetorch

BUGGY = textwrap.dedent("""\
    import torch
    x = torch.ones(2)
    for _ in range(3):
        x.double()
    model = torch.nn.Linear(2, 2).eval()
    for _ in range(3):
        y = model(x)
    print("done")
""")


@pytest.fixture
def buggy(tmp_path: os.PathLike[str]) -> str:
    path = os.path.join(tmp_path, "train.py")
    with open(path, "w") as fh:
        fh.write(BUGGY)
    return path


def test_version_rules_and_explain(tmp_path: os.PathLike[str]) -> None:
    version = _safetorch(["--version"], str(tmp_path))
    assert version.returncode == 0 and version.stdout.split()[-1] == safetorch.__version__
    rules = _safetorch(["rules"], str(tmp_path))
    assert rules.returncode == 0
    lines = rules.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == list(safetorch.RULES)
    # aligned: every summary starts in the same column, however long the rule's name
    columns = {ln.index(r.summary) for ln, r in zip(lines, safetorch.RULES.values(), strict=True)}
    assert len(columns) == 1
    page = _safetorch(["explain", "eval-mode-grad"], str(tmp_path))
    with open(os.path.join(ROOT, "docs", "rules", "ST003.md")) as fh:
        assert page.returncode == 0 and page.stdout.strip() == fh.read().strip()
    unknown = _safetorch(["explain", "ST03"], str(tmp_path))
    assert unknown.returncode == 2 and "unknown rule 'ST03'" in unknown.stderr and "ST003 (eval-mode-grad)" in \
        unknown.stderr


def test_double_dash_runs_a_script_named_like_a_subcommand(tmp_path: os.PathLike[str]) -> None:
    with open(os.path.join(tmp_path, "rules"), "w") as fh:
        fh.write("import sys; print('script ran', sys.argv)\n")
    proc = _safetorch(["--", "rules", "--lr", "1"], str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "script ran ['rules', '--lr', '1']" in proc.stdout


@pytest.mark.slow
def test_exit_status_follows_findings_unless_the_program_fails(buggy: str, tmp_path: os.PathLike[str]) -> None:
    found = _safetorch([buggy], str(tmp_path))
    assert found.returncode == 1 and "done" in found.stdout
    assert "exit status 1 for these findings" in found.stderr and "--exit-zero" in found.stderr
    assert _safetorch(["--exit-zero", buggy], str(tmp_path)).returncode == 0
    assert _safetorch(["--select", "ST005", buggy], str(tmp_path)).returncode == 0  # nothing selected fired
    failing = os.path.join(tmp_path, "fails.py")
    with open(failing, "w") as fh:
        fh.write(BUGGY + "raise SystemExit(3)\n")
    assert _safetorch([failing], str(tmp_path)).returncode == 3  # the program's own status wins
    clean = os.path.join(tmp_path, "clean.py")
    with open(clean, "w") as fh:
        fh.write("import torch\nx = torch.ones(2).double()\nraise SystemExit(0)\n")
    assert _safetorch([clean], str(tmp_path)).returncode == 0


@pytest.mark.slow
def test_select_and_ignore_errors_name_the_option(buggy: str, tmp_path: os.PathLike[str]) -> None:
    proc = _safetorch(["--ignore", "ST03", buggy], str(tmp_path))
    assert proc.returncode == 2 and "error: --ignore: unknown rule 'ST03'" in proc.stderr and "ignore=" not in \
        proc.stderr
    proc = _safetorch(["--select", "nope", buggy], str(tmp_path))
    assert proc.returncode == 2 and "error: --select: unknown rule 'nope'" in proc.stderr
    only = _safetorch(["--select", "ST003", "--exit-zero", buggy], str(tmp_path))
    assert "ST003" in only.stderr and "ST001" not in only.stderr


def test_messages_end_with_their_rule_page_and_the_summary_is_one_line_each(buggy: str,
                                                                            tmp_path: os.PathLike[str]) -> None:
    proc = _safetorch([buggy], str(tmp_path))
    warning = next(ln for ln in proc.stderr.splitlines() if "DiscardedConversionWarning" in ln)
    assert warning.endswith("Write: x = x.double() (safetorch explain ST001)")
    summary = proc.stderr[proc.stderr.index("safetorch: 2 finding(s)"):].splitlines()
    assert summary[1] == f"  ST001 {buggy}:4 (x3): x.double() returns a copy and its result is discarded"
    assert summary[2].startswith(f"  ST003 {buggy}:7 (x1): model (Linear) is in eval mode with autograd on")
    assert summary[2].endswith("(x1): model (Linear) is in eval mode with autograd on")  # its first clause only


def test_concise_format_prints_each_warning_in_one_line_with_its_fix(buggy: str, tmp_path: os.PathLike[str]) -> None:
    proc = _safetorch(["--format", "concise", buggy], str(tmp_path))
    summary = proc.stderr.index("safetorch: 2 finding(s)")
    assert proc.stderr[:summary].splitlines() == [  # nothing else: no source line below a warning
        f"{buggy}:4: DiscardedConversionWarning: ST001 x.double() returns a copy and its result is discarded. "
        "Write: x = x.double() (safetorch explain ST001)",
        f"{buggy}:7: EvalModeGradWarning: ST003 model (Linear) is in eval mode with autograd on. Write: `with "
        "torch.no_grad():` around the evaluation (or model.train() if you train through this forward) "
        "(safetorch explain ST003)"]


SAMPLED = textwrap.dedent("""\
    import torch
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(24):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
""")


def test_a_sampled_count_says_it_is_one(tmp_path: os.PathLike[str]) -> None:
    """ST011 looks at an optimizer's first 8 steps (then two every 1024 backwards): of 24 steps without zero_grad(),
    it sees 7 (the first has nothing to accumulate) — a count of sampled steps, not of the 23 that accumulated."""
    with open(os.path.join(tmp_path, "train.py"), "w") as fh:
        fh.write(SAMPLED)
    text = _safetorch(["train.py"], str(tmp_path))
    script = os.path.join(tmp_path, "train.py")
    assert f"  ST011 {script}:6 (seen at 7 sampled steps): opt.step() uses the sum of the gradients of every step " \
        "so far\n" in text.stderr
    concise = _safetorch(["--format", "concise", "train.py"], str(tmp_path))
    assert concise.stderr.splitlines()[0] == (  # a fix that is no "Write:" is the concise line's too
        f"{script}:6: GradientsAccumulateWarning: ST011 opt.step() uses the sum of the gradients of every step so "
        "far. Call opt.zero_grad() once per step: before loss.backward(), or right after opt.step() (to accumulate "
        "over several batches on purpose, zero after each step) (safetorch explain ST011)")
    github = _safetorch(["--format", "github", "train.py"], str(tmp_path))
    assert github.stdout.startswith("::warning file=train.py,line=6,title=ST011 gradients-accumulate-across-steps "
                                    "(seen at 7 sampled steps)::ST011 ")
    document = json.loads(_safetorch(["--format", "json", "train.py"], str(tmp_path)).stdout)
    assert [(e["rule"], e["count"], e["sampled"]) for e in document] == [("ST011", 7, True)]


def test_github_format_is_workflow_commands(buggy: str, tmp_path: os.PathLike[str]) -> None:
    proc = _safetorch(["--format", "github", "train.py"], str(tmp_path))
    assert proc.returncode == 1
    commands = [ln for ln in proc.stdout.splitlines() if ln.startswith("::")]
    assert len(commands) == 2
    parsed = []
    unescape = {"%25": "%", "%0D": "\r", "%0A": "\n", "%3A": ":", "%2C": ","}

    def unquote(value: str) -> str:
        return re.sub("%25|%0D|%0A|%3A|%2C", lambda m: unescape[m[0]], value)

    for line in commands:
        match = re.fullmatch(r"::warning (?P<props>[^:]*)::(?P<message>.*)", line)
        assert match is not None, line
        props = dict(p.split("=", 1) for p in match["props"].split(","))
        props = {k: unquote(v) for k, v in props.items()}
        parsed.append((props, match["message"]))
    assert parsed[0][0] == {"file": "train.py", "line": "4", "title": "ST001 discarded-conversion (x3)"}
    assert parsed[0][1].startswith("ST001 x.double() returns a copy")
    assert parsed[1][0]["title"] == "ST003 eval-mode-grad" and parsed[1][0]["line"] == "7"


def test_json_report_fields(buggy: str, tmp_path: os.PathLike[str]) -> None:
    proc = _safetorch(["--format", "json", "--exit-zero", "train.py"], str(tmp_path))
    data = json.loads(proc.stdout[proc.stdout.index("["):])
    assert [(e["rule"], e["name"], e["line"], e["count"], e["sampled"]) for e in data] == [
        ("ST001", "discarded-conversion", 4, 3, False), ("ST003", "eval-mode-grad", 7, 1, False)]
    for entry in data:
        assert entry["abspath"] == buggy and os.path.isabs(entry["abspath"])
        assert entry["pids"] == [entry["pid"]] and entry["rank"] is None
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", entry["first_seen"])
        assert entry["message"].endswith(f"(safetorch explain {entry['rule']})")


PRINTING = textwrap.dedent("""\
    import subprocess, sys, torch
    print("epoch 1 loss 0.25 [")
    x = torch.ones(2)
    x.double()
    subprocess.run([sys.executable, "-c", "print('from a child process {')"], check=True)
    sys.stdout.write("no newline at the end")
""")


@pytest.mark.parametrize("fmt", ["json", "sarif"])
def test_a_machine_format_owns_stdout_and_the_programs_output_goes_to_stderr(fmt: str,
                                                                             tmp_path: os.PathLike[str]) -> None:
    with open(os.path.join(tmp_path, "train.py"), "w") as fh:
        fh.write(PRINTING)
    proc = _safetorch(["--format", fmt, "train.py"], str(tmp_path), PYTHONUNBUFFERED="")  # stdout: buffered
    assert proc.returncode == 1, proc.stderr

    def places(document: Any) -> list[tuple[str, int]]:
        if fmt == "sarif":
            return [(r["ruleId"], r["locations"][0]["physicalLocation"]["region"]["startLine"])
                    for r in document["runs"][0]["results"]]
        return [(e["rule"], e["line"]) for e in document]

    assert places(json.loads(proc.stdout)) == [("ST001", 4)]  # the whole of stdout, as `> out.json` keeps it
    for printed in ("epoch 1 loss 0.25 [", "from a child process {", "no newline at the end"):
        assert printed in proc.stderr and printed not in proc.stdout
    # in the order it was printed: line by line, not held in the buffer of a stdout that was a pipe
    assert proc.stderr.index("epoch 1 loss 0.25 [") < proc.stderr.index("DiscardedConversionWarning") < \
        proc.stderr.index("from a child process {")
    # with a named file the document goes there, and the program keeps its stdout
    named = _safetorch(["--format", fmt, "--report", "out.json", "train.py"], str(tmp_path))
    assert named.stdout == "epoch 1 loss 0.25 [\nfrom a child process {\nno newline at the end"
    with open(os.path.join(tmp_path, "out.json")) as fh:
        assert places(json.load(fh)) == [("ST001", 4)]
    helped = " ".join(_safetorch(["--help"], str(tmp_path)).stdout.split())
    assert "json / sarif: the report on stdout at exit, which it owns: the program's own stdout goes to stderr" \
        in helped


def _sarif_schema() -> dict[str, object]:
    """The parts of the SARIF 2.1.0 schema (OASIS, sarif-schema-2.1.0.json) that describe what safetorch writes,
    with each object closed (``additionalProperties: false``, as the schema has them), so that a misspelt or
    misplaced property fails. The full schema is not installable from the package index."""
    def obj(required: list[str], **props: object) -> dict[str, object]:
        return {"type": "object", "additionalProperties": False, "required": required, "properties": props}

    message = obj(["text"], text={"type": "string"})
    multiformat = obj(["text"], text={"type": "string"}, markdown={"type": "string"})
    bag = {"type": "object"}
    rule = obj(["id"], id={"type": "string"}, name={"type": "string"}, shortDescription=multiformat,
               help=multiformat, defaultConfiguration=obj([], level={"enum": ["none", "note", "warning", "error"]}))
    location = obj([], physicalLocation=obj(
        [], artifactLocation=obj([], uri={"type": "string", "format": "uri-reference"}, uriBaseId={"type": "string"}),
        region=obj([], startLine={"type": "integer", "minimum": 1})))
    result = obj(["message"], ruleId={"type": "string"}, ruleIndex={"type": "integer", "minimum": -1},
                 level={"enum": ["none", "note", "warning", "error"]}, message=message,
                 locations={"type": "array", "items": location}, properties=bag)
    driver = obj(["name"], name={"type": "string"}, version={"type": "string"},
                 rules={"type": "array", "items": rule, "uniqueItems": True})
    run = obj(["tool"], tool=obj(["driver"], driver=driver), results={"type": "array", "items": result},
              originalUriBaseIds={"type": "object", "additionalProperties": obj([], uri={"type": "string"})})
    return obj(["version", "runs"], **{"$schema": {"type": "string", "format": "uri"}, "version": {"enum": ["2.1.0"]},
                                       "runs": {"type": "array", "items": run}})


def test_sarif_report_is_valid_and_points_at_the_lines(buggy: str, tmp_path: os.PathLike[str]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    out = os.path.join(tmp_path, "findings.sarif")
    proc = _safetorch(["--format", "sarif", "--report", out, "train.py"], str(tmp_path))
    assert proc.returncode == 1
    with open(out) as fh:
        log = json.load(fh)
    jsonschema.validate(log, _sarif_schema())
    run = log["runs"][0]
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == list(safetorch.RULES)
    places = [(r["ruleId"], r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
               r["locations"][0]["physicalLocation"]["region"]["startLine"], r["properties"]["count"])
              for r in run["results"]]
    assert places == [("ST001", "train.py", 4, 3), ("ST003", "train.py", 7, 1)]
    for r in run["results"]:
        assert run["tool"]["driver"]["rules"][r["ruleIndex"]]["id"] == r["ruleId"]
    # a misspelt property would fail the check
    bad = json.loads(json.dumps(log))
    bad["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startline"] = 4
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _sarif_schema())


PYPROJECT = textwrap.dedent("""\
    [project]
    name = "demo"

    [tool.safetorch]
    ignore = ["ST003"]
    format = "concise"
    colour = "red"
""")


@pytest.mark.slow
def test_pyproject_settings_below_environment_and_options(buggy: str, tmp_path: os.PathLike[str]) -> None:
    with open(os.path.join(tmp_path, "pyproject.toml"), "w") as fh:
        fh.write(PYPROJECT)
    sub = os.path.join(tmp_path, "scripts")
    os.makedirs(sub)
    proc = _safetorch([buggy], sub)  # found from the script's directory upward, as ruff and pytest find theirs
    assert "ST003" not in proc.stderr and "ST001 x.double() returns a copy and its result is discarded. Write: " \
        "x = x.double() (safetorch explain ST001)\n" in proc.stderr  # concise
    pyproject = os.path.join(tmp_path, "pyproject.toml")
    assert f"{pyproject}:7: SafetorchConfigWarning: safetorch: {pyproject} [tool.safetorch]: unknown key 'colour'" \
        in proc.stderr
    env = _safetorch([buggy], sub, SAFETORCH_IGNORE="ST001", SAFETORCH_FORMAT="text")  # environment > pyproject
    assert "ST003" in env.stderr and "DiscardedConversionWarning" not in env.stderr
    assert "Write: `with torch.no_grad():`" in env.stderr  # text: the warning in full
    option = _safetorch(["--ignore", "ST003,ST001", buggy], sub, SAFETORCH_IGNORE="")  # options > environment
    assert option.returncode == 0 and "Warning: ST0" not in option.stderr
    elsewhere = _safetorch([buggy], os.path.dirname(str(tmp_path)))  # the script's file, wherever the shell is
    assert "ST003" not in elsewhere.stderr and "unknown key 'colour'" in elsewhere.stderr


def test_pyproject_is_read_by_import_and_by_the_pytest_plugin(tmp_path: os.PathLike[str]) -> None:
    with open(os.path.join(tmp_path, "pyproject.toml"), "w") as fh:
        fh.write('[tool.safetorch]\nselect = ["discarded-conversion"]\nstrict = true\n')
    with open(os.path.join(tmp_path, "test_model.py"), "w") as fh:
        fh.write("import torch\n\ndef test_eval():\n    torch.nn.Linear(2, 2).eval()(torch.ones(2))\n\n"
                 "def test_discard():\n    torch.ones(2).double()\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--safetorch",
                           "test_model.py"], capture_output=True, text=True, cwd=str(tmp_path), env=_env(),
                          timeout=300)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "SafetorchError: ST001" in proc.stdout


def test_bad_values_in_pyproject_warn_and_are_ignored(tmp_path: os.PathLike[str]) -> None:
    from safetorch import _config

    path = os.path.join(tmp_path, "pyproject.toml")
    with open(path, "w") as fh:
        fh.write('[tool.safetorch]\nstrict = "yes"\nignore = ["ST999", "ST004"]\nformat = "xml"\nreport = "r.json"\n')
    with pytest.warns(safetorch.SafetorchConfigWarning) as caught:
        cfg = _config.from_pyproject(path)
    assert cfg.strict is False and cfg.ignore == {"ST004"} and cfg.format == "text"
    assert cfg.report == os.path.join(str(tmp_path), "r.json")  # relative to the file, as ruff's paths are
    assert {(w.filename, w.lineno) for w in caught} == {(path, 2), (path, 3), (path, 4)}
    os.makedirs(os.path.join(str(tmp_path), "a", "b"))
    assert _config.find_pyproject(os.path.join(str(tmp_path), "a", "b")) == path


def test_help_table_is_aligned_and_errors_name_the_option_typed(buggy: str, tmp_path: os.PathLike[str]) -> None:
    helped = _safetorch(["--help"], str(tmp_path))
    rows = [ln for ln in helped.stdout.splitlines() if re.match(r"  ST\d{3}  ", ln)]
    assert len(rows) == len(safetorch.RULES)
    assert len({ln.index(r.summary) for ln, r in zip(rows, safetorch.RULES.values(), strict=True)}) == 1
    target = os.path.join(tmp_path, "missing", "report.json")
    proc = _safetorch(["--report", target, buggy], str(tmp_path))
    assert f"safetorch: the report {target!r} could not be written" in proc.stderr
    assert "SAFETORCH_REPORT" not in proc.stderr


@pytest.mark.slow
def test_the_wheel_ships_the_rule_pages_and_py_typed(tmp_path: os.PathLike[str]) -> None:
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), ROOT], check=True, capture_output=True, timeout=600)
    wheel = next(os.path.join(tmp_path, n) for n in os.listdir(tmp_path) if n.endswith(".whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "safetorch/py.typed" in names
    assert {f"safetorch/_docs/rules/{code}.md" for code in safetorch.RULES} <= names


def test_a_selection_of_nothing_leaves_every_rule_on(buggy: str, tmp_path: os.PathLike[str]) -> None:
    with open(os.path.join(tmp_path, "pyproject.toml"), "w") as fh:
        fh.write('[tool.safetorch]\nselect = ["ST0001"]\nignore = ["ST003"]\n')
    proc = _safetorch([buggy], str(tmp_path))
    assert "select names no rule; every rule stays on" in proc.stderr and "DiscardedConversionWarning" in proc.stderr
    assert "EvalModeGradWarning" not in proc.stderr  # the file's ignore still holds
    chosen = _safetorch(["--select", "ST003", buggy], str(tmp_path))  # an explicit select beats the file's ignore
    assert "EvalModeGradWarning" in chosen.stderr and "DiscardedConversionWarning" not in chosen.stderr
    empty = _safetorch(["--select", "", buggy], str(tmp_path))
    assert empty.returncode == 2 and "--select names no rule" in empty.stderr


def test_a_pyproject_whose_tool_is_no_table_is_no_crash(buggy: str, tmp_path: os.PathLike[str]) -> None:
    with open(os.path.join(tmp_path, "pyproject.toml"), "w") as fh:
        fh.write('tool = "x"\n')
    proc = _safetorch([buggy], str(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "DiscardedConversionWarning" in proc.stderr
    with open(os.path.join(tmp_path, "pyproject.toml"), "w") as fh:
        fh.write('[tool]\nsafetorch = 3\n')
    proc = _safetorch([buggy], str(tmp_path))
    assert "tool.safetorch must be a table" in proc.stderr and "DiscardedConversionWarning" in proc.stderr


def test_the_runner_reads_only_its_scripts_pyproject(tmp_path: os.PathLike[str]) -> None:
    with open(os.path.join(tmp_path, "pyproject.toml"), "w") as fh:
        fh.write("[tool.safetorch]\nbogus = 1\n")
    project = os.path.join(tmp_path, "proj")
    os.makedirs(project)
    with open(os.path.join(project, "pyproject.toml"), "w") as fh:
        fh.write('[tool.safetorch]\nignore = ["ST001"]\n')
    with open(os.path.join(project, "f.py"), "w") as fh:
        fh.write("import torch\ntorch.ones(2).double()\n")
    proc = _safetorch(["proj/f.py"], str(tmp_path))
    assert proc.returncode == 0 and proc.stderr == ""  # no word of the working directory's file: it is not used


def test_findings_of_threads_count_and_paths_are_the_starts(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "threads.py")
    with open(script, "w") as fh:
        fh.write(textwrap.dedent("""\
            import os, sys, threading, time, torch
            def late():
                time.sleep(0.3)
                torch.ones(2).double()
            threading.Thread(target=late).start()
            os.makedirs("sub", exist_ok=True)
            os.chdir("sub")
            sys.stdout = open("log.txt", "w")
            print("the program's log")
        """))
    proc = _safetorch(["--format", "json", "threads.py"], str(tmp_path))
    assert proc.returncode == 1, proc.stderr  # the thread's finding came after the script's last line
    data = json.loads(proc.stdout)  # the document alone: the program's own output went to its log
    assert [(e["rule"], e["path"], e["line"]) for e in data] == [("ST001", script, 4)]
    report = _safetorch(["--report", "r.json", "--exit-zero", "threads.py"], str(tmp_path))
    assert report.returncode == 0 and os.path.exists(os.path.join(tmp_path, "r.json"))  # not sub/r.json
    github = _safetorch(["--format", "github", "threads.py"], str(tmp_path), GITHUB_WORKSPACE=os.path.dirname(
        str(tmp_path)))
    assert f"::warning file={os.path.basename(str(tmp_path))}/threads.py,line=4," in github.stdout
