"""Every rule has its page in docs/rules/ (bad and good code, how to silence it) and its row in the README's table."""

from __future__ import annotations

import os

import pytest

import safetorch

from .conftest import ROOT


@pytest.mark.parametrize("code", sorted(safetorch.RULES))
def test_every_rule_has_a_page_with_code_and_a_way_to_silence_it(code: str) -> None:
    rule = safetorch.RULES[code]
    with open(os.path.join(ROOT, "docs", "rules", f"{code}.md")) as fh:
        page = fh.read()
    assert page.startswith(f"# {code} `{rule.name}`")
    assert "```python" in page and "Message:" in page
    assert f"# safetorch: ignore[{code}]" in page and f"SAFETORCH_IGNORE={code}" in page
    with open(os.path.join(ROOT, "README.md")) as fh:
        assert f"| [{code}](docs/rules/{code}.md) |" in fh.read()


def test_everything_about_a_rule_is_derived_from_its_one_declaration() -> None:
    """A rule is declared once, in its check module (RULE = Rule(...)): the exports, __all__, the installer's table
    and the accepted names follow from it."""
    from safetorch import _install, _rules

    for code, rule in safetorch.RULES.items():
        module = __import__(f"safetorch.checks.{rule.module}", fromlist=["RULE"])
        assert module.RULE.code == code and module.RULE.category is rule.category
        assert getattr(safetorch, rule.category.__name__) is rule.category
        assert rule.category.__name__ in safetorch.__all__ and rule.category.__module__ == "safetorch"
        assert _rules.resolve(rule.name) == code and _rules.resolve(code.lower()) == code
    assert _install.checks() == {code: rule.module for code, rule in safetorch.RULES.items()}
    assert safetorch.installed_checks() == sorted(safetorch.RULES)


@pytest.mark.slow
def test_the_readmes_commands_run() -> None:
    """Every `python -m ...` command in the README's shell blocks runs from the repository root (the set-up line's
    pip installs are what CI's .ci/run does; the test suite itself is run with --collect-only here)."""
    import re
    import subprocess
    import sys

    with open(os.path.join(ROOT, "README.md")) as fh:
        blocks = re.findall(r"```bash\n(.*?)```", fh.read(), re.S)
    commands = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    commands = [c for c in commands if c.startswith("python -m ") and "venv" not in c]
    assert "python -m safetorch examples/demo.py" in commands
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    for command in commands + ["python -m pytest --collect-only -q"]:
        args = command.split()[1:]
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                              timeout=300)
        # the runner exits 1 for a program that succeeded with findings, as a linter does
        expected = 1 if args[:2] == ["-m", "safetorch"] and "examples/" in command else 0
        assert proc.returncode == expected, (command, proc.stderr[-2000:])


@pytest.mark.slow
def test_the_readmes_example_findings_are_what_the_examples_print() -> None:
    """The README shows the findings of four scripts in examples/: each line is what the runner prints, verbatim,
    with the checkout's directory left out of the paths (Python prints a script's absolute path)."""
    import re
    import subprocess
    import sys

    with open(os.path.join(ROOT, "README.md")) as fh:
        shown = re.findall(r"^(examples/(\w+)\.py:\d+: \w+Warning: ST0\d\d .*)$", fh.read(), re.M)
    scripts = sorted({name for _, name in shown})
    assert scripts == [
        "eval_loop_in_train_mode", "forgot_train_toggle", "forgot_zero_grad", "softmax_into_cross_entropy"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    for name in scripts:
        proc = subprocess.run([sys.executable, "-m", "safetorch", f"examples/{name}.py"], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=300)
        assert proc.returncode == 1, proc.stderr  # it succeeded, with findings
        lines = [line.replace(os.path.join(os.path.realpath(ROOT), ""), "") for line in proc.stderr.splitlines()]
        printed = [line for line in lines if re.match(r"examples/\w+\.py:\d+: \w+Warning", line)]
        assert printed == [line for line, script in shown if script == name]
