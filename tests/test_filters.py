"""A ``warnings`` filter that names a rule switches it off where it applies: no action (ST003 runs the forward as
written), no summary entry, no strict raise — in every form a user writes one. A filter that names no rule only hides
messages; ``ignore:ST01`` (a typo for ST001) names none, and says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import DiscardedConversionWarning, EvalModeGradWarning, SafetorchConfigWarning, _report

from .conftest import ROOT, findings, lineno
from .test_eval_mode_grad import keeps_activations


def _evaluate(model: nn.Module, times: int = 4) -> list[bool]:
    return [keeps_activations(lambda: model(torch.randn(2, 4)))[1] for _ in range(times)]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).eval()


@pytest.mark.parametrize("form", ["message", "category", "all rules"])
def test_a_filter_naming_st003_switches_it_off_where_it_applies(form: str) -> None:
    model = _model()
    with warnings.catch_warnings():
        if form == "message":
            warnings.filterwarnings("ignore", "ST003")
        elif form == "category":
            warnings.filterwarnings("ignore", category=EvalModeGradWarning)
        else:
            warnings.filterwarnings("ignore", category=safetorch.SafetorchWarning)
        off = _evaluate(model)
    assert off == [True] * 4  # every forward as written: the rule does nothing
    assert not _report.findings()  # and nothing for the summary
    with findings() as got:
        on = _evaluate(model)  # the same site, the filter gone: the rule acts again (its first forward was watched)
    assert on == [False] * 4 and [w.category for w in got] == [EvalModeGradWarning]


def test_a_blanket_ignore_hides_the_message_and_the_rule_still_acts() -> None:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # names no rule: a library silencing its own noise
        kept = _evaluate(model)
    assert kept == [True, False, False, False]
    assert [s.code for s in _report.findings()] == ["ST003"]


def test_a_filter_for_one_line_leaves_the_others_on() -> None:
    x = torch.ones(2)
    with findings() as got:
        warnings.filterwarnings("ignore", "ST001", lineno=lineno() + 1)
        x.double()
        x.double(); line = lineno()  # noqa: E702
    assert [(w.category, w.lineno) for w in got] == [(DiscardedConversionWarning, line)]
    assert [(s.code, s.lineno) for s in _report.findings()] == [("ST001", line)]


def test_a_strict_run_does_not_raise_for_a_rule_a_filter_names() -> None:
    safetorch.install(strict=True)
    x = torch.ones(2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ST001")
        x.double()
    with pytest.raises(safetorch.SafetorchError):
        x.double()


def test_a_code_prefix_names_no_rule_and_says_so_once() -> None:
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", "ST01")
        for _ in range(2):
            x.double(); line = lineno()  # noqa: E702
    config = [w for w in got if w.category is SafetorchConfigWarning]
    assert len(config) == 1 and "'ignore:ST01' names no rule" in str(config[0].message)
    assert (config[0].filename, config[0].lineno) == (__file__, line)
    assert [(s.code, s.count) for s in _report.findings()] == [("ST001", 2)]  # ST001 acts and counts


PROGRAM = textwrap.dedent("""\
    import torch
    import safetorch
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()).eval()
    kept = []
    for _ in range(4):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t.detach(), lambda t: t):
            m(torch.ones(1, 4))
        kept.append(bool(packed))
    print("kept", kept)
    x = torch.ones(2)
    x.double()
""")


def _python(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_") and k != "PYTHONWARNINGS"}
    full.update(env, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full, timeout=300)


@pytest.mark.parametrize("how", ["-W", "PYTHONWARNINGS", "runner -W"])
def test_command_line_and_environment_filters_switch_a_rule_off(how: str, tmp_path: str) -> None:
    path = os.path.join(tmp_path, "prog.py")
    with open(path, "w") as fh:
        fh.write(PROGRAM)
    if how == "-W":
        proc = _python("-W", "ignore:ST003", path)
    elif how == "PYTHONWARNINGS":
        proc = _python(path, PYTHONWARNINGS="ignore:ST003")
    else:
        proc = _python("-W", "ignore:ST003", "-m", "safetorch", "--strict", path)
    assert proc.returncode == (1 if how == "runner -W" else 0), proc.stderr
    assert "kept [True, True, True, True]" in proc.stdout  # ST003 does nothing
    assert "ST003" not in proc.stderr  # no message, no summary line
    if how == "runner -W":  # strict: the rule that is on still raises
        assert "SafetorchError: ST001" in proc.stderr
    else:
        assert "ST001" in proc.stderr


TEST_FILE = textwrap.dedent("""\
    import pytest
    import torch

    def test_plain():
        torch.ones(2).double()

    @pytest.mark.filterwarnings("ignore:ST001")
    def test_marked():
        torch.ones(2).double()

    def test_legacy():
        torch.nn.MSELoss(size_average=False)
""")


@pytest.mark.parametrize("ini", ["", "filterwarnings =\n    ignore:ST002\n"])
def test_pytest_ini_and_marker_filters_switch_a_rule_off(ini: str, tmp_path: str) -> None:
    with open(os.path.join(tmp_path, "test_user.py"), "w") as fh:
        fh.write(TEST_FILE)
    with open(os.path.join(tmp_path, "pytest.ini"), "w") as fh:
        fh.write("[pytest]\n" + ini)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--safetorch-strict",
                           "-rA", "test_user.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    out = proc.stdout
    assert "FAILED test_user.py::test_plain" in out  # unmarked: the strict finding fails the test
    assert "PASSED test_user.py::test_marked" in out  # the marker switched ST001 off for that test
    legacy = "PASSED" if ini else "FAILED"
    assert f"{legacy} test_user.py::test_legacy" in out  # the ini filter switched ST002 off everywhere
