"""Configuration: environment read once, explicit arguments override, bad input answered clearly."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

import safetorch
from safetorch import _config
from safetorch._config import Config, from_environ

from .conftest import run_python


def test_defaults() -> None:
    assert from_environ({}) == Config(strict=False, disabled=False, ignore=frozenset(), report=True)


def test_every_variable() -> None:
    cfg = from_environ({"SAFETORCH_STRICT": "1", "SAFETORCH_DISABLE": "true", "SAFETORCH_IGNORE": "ST004, st007",
                        "SAFETORCH_REPORT": "out.json"})
    # a relative report path is the starting directory's, whatever the program's working directory at exit
    assert cfg == Config(strict=True, disabled=True, ignore=frozenset({"ST004", "ST007"}),
                         report=os.path.abspath("out.json"))
    assert from_environ({"SAFETORCH_REPORT": "0"}).report is False


def test_ignore_takes_names_too() -> None:
    assert from_environ({"SAFETORCH_IGNORE": "graph-accumulation,Empty-Cache-Loop"}).ignore == {"ST004", "ST007"}


def test_bad_environment_values_warn_once_each_and_are_ignored() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = from_environ({"SAFETORCH_STRICT": "maybe", "SAFETORCH_IGNORE": "ST004,ST999"})
    assert cfg.strict is False and cfg.ignore == {"ST004"}
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert all(w.category is safetorch.SafetorchConfigWarning for w in caught)
    assert any("SAFETORCH_STRICT='maybe'" in m for m in messages)
    assert any("'ST999'" in m and "ST001 (discarded-conversion)" in m for m in messages)


def test_unknown_code_in_install_raises_naming_the_valid_codes() -> None:
    with pytest.raises(ValueError, match=r"unknown rule 'ST042'.*ST001 \(discarded-conversion\).*ST007"):
        safetorch.install(ignore=["ST042"])


def test_explicit_arguments_override_the_environment() -> None:
    base = from_environ({"SAFETORCH_STRICT": "1", "SAFETORCH_IGNORE": "ST001"})
    cfg = base.with_overrides(strict=False, ignore=())
    assert cfg.strict is False and cfg.ignore == frozenset()
    assert base.with_overrides().strict is True  # None keeps the environment's value
    safetorch.install(strict=True)
    assert _config.current.strict is True


def test_import_never_raises_on_bad_environment() -> None:
    proc = run_python("import safetorch; print(safetorch.installed_checks())",
                      env={"SAFETORCH_STRICT": "sure", "SAFETORCH_IGNORE": "nonsense", "SAFETORCH_REPORT": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "ST001" in proc.stdout
    assert proc.stderr.count("SafetorchConfigWarning") == 2


def test_environment_strict_and_ignore_apply_on_import() -> None:
    code = "import torch, safetorch; x = torch.ones(2)\ntry:\n    x.float()\nexcept safetorch.SafetorchError as e:\n" \
           "    print('raised', e.code)\nelse:\n    print('silent')"
    assert run_python(code, env={"SAFETORCH_STRICT": "1"}).stdout.strip() == "raised ST001"
    assert run_python(code, env={"SAFETORCH_STRICT": "1", "SAFETORCH_IGNORE": "ST001"}).stdout.strip() == "silent"


def test_a_bad_environment_value_warns_at_the_line_that_imported_safetorch(tmp_path: Path) -> None:
    """The warning names the program's ``import safetorch``, as a library's warnings name their caller, not
    safetorch's own file."""
    script = tmp_path / "train.py"
    script.write_text(
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import safetorch\n"
        "print(json.dumps([(w.category.__name__, w.filename, w.lineno) for w in caught]))\n"
    )
    proc = run_python(f"import runpy; runpy.run_path({str(script)!r})",
                      env={"SAFETORCH_STRICT": "maybe", "SAFETORCH_IGNORE": "ST999", "SAFETORCH_REPORT": "0"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [["SafetorchConfigWarning", str(script), 4]] * 2


def test_a_bad_environment_value_warns_at_python_c_and_at_install() -> None:
    """``python -W always -c "import safetorch"`` shows ``<string>:1``; a bad value met first by an explicit
    ``install()`` names that call's line."""
    proc = run_python("import safetorch", env={"SAFETORCH_STRICT": "maybe", "SAFETORCH_REPORT": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("<string>:1: SafetorchConfigWarning: safetorch: SAFETORCH_STRICT='maybe' is not "
                                  "understood"), proc.stderr
    code = ("import os, warnings\nos.environ['SAFETORCH_IGNORE'] = 'ST999'\nfrom safetorch import _install\n"
            "_install._env_config = None\nwith warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n    _install.install()\n"
            "print([(w.filename, w.lineno) for w in caught])")
    proc = run_python(code, env={"SAFETORCH_REPORT": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[('<string>', 7)]"
