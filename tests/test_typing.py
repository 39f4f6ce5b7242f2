"""The package is typed (py.typed): a user's script that calls the public surface passes `mypy --strict`, and the
per-rule warning classes, exported at run time from the rule table, are named for type checkers too."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import safetorch

from .conftest import ROOT

USER_SCRIPT = textwrap.dedent("""\
    import warnings

    import safetorch

    safetorch.install(strict=False, ignore=["ST004"], select=None)
    safetorch.install(ignore="ST004,empty-cache-loop")

    with safetorch.ignore("ST003"):
        pass
    with safetorch.ignore("ST003", ["graph-accumulation"]) as scope:
        assert scope is not None


    @safetorch.ignore("ST001")
    def scale(x: float, factor: int = 2) -> float:
        return x * factor


    @safetorch.ignore()
    async def fetch(n: int) -> str:
        return str(n)


    scaled: float = scale(1.5, factor=3)
    for f in safetorch.findings():
        code: str = f.code
        line: int = f.lineno
        count: int = f.count
        shown: str = str(f)
    safetorch.reset()
    assert issubclass(safetorch.DiscardedConversionWarning, safetorch.SafetorchWarning)
    assert issubclass(safetorch.SafetorchError, RuntimeError)
    warnings.filterwarnings("error", category=safetorch.EvalModeGradWarning)
    checks: list[str] = safetorch.installed_checks()
    version: str = safetorch.__version__
    safetorch.uninstall()
""")

# safetorch as an installed package: mypy reports no errors inside an installed package, only the user's. (An editable
# install is an import hook mypy cannot follow, so the checkout is named on mypy's path.) torch's own types are torch's
# business and take mypy a minute to read: skipped.
MYPY_INI = textwrap.dedent("""\
    [mypy]
    mypy_path = {root}
    [mypy-safetorch.*]
    follow_imports = silent
    [mypy-torch.*]
    follow_imports = skip
""")


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for this module's runs: the second reads safetorch from it."""
    return tmp_path_factory.mktemp("mypy_cache")


def _mypy_strict(tmp_path: Path, cache: Path, script: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")
    (tmp_path / "script.py").write_text(script)
    (tmp_path / "mypy.ini").write_text(MYPY_INI.format(root=ROOT))
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file", "mypy.ini", "--cache-dir",
                           str(cache), "script.py"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)


def test_a_script_using_the_public_surface_passes_mypy_strict(tmp_path: Path, mypy_cache: Path) -> None:
    proc = _mypy_strict(tmp_path, mypy_cache, USER_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_wrong_type_through_the_decorator_is_an_error(tmp_path: Path, mypy_cache: Path) -> None:
    """`@safetorch.ignore(...)` keeps the function's signature: mypy still sees through it (so the test above can
    fail)."""
    proc = _mypy_strict(tmp_path, mypy_cache, USER_SCRIPT + 'wrong: str = scale(1.5)\n')
    assert proc.returncode == 1 and 'has type "float", variable has type "str"' in proc.stdout, proc.stdout


def test_every_rules_warning_class_is_named_for_type_checkers() -> None:
    """safetorch/__init__.py exports the classes from the rule table at run time; its `if TYPE_CHECKING:` block
    must import each one explicitly, from its check, under its own name (a new rule adds its line there)."""
    with open(os.path.join(ROOT, "safetorch", "__init__.py")) as fh:
        tree = ast.parse(fh.read())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    named = {(node.module, alias.name, alias.asname) for node in block.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    wanted = {(f"checks.{rule.module}", rule.category.__name__, rule.category.__name__)
              for rule in safetorch.RULES.values()}
    assert named == wanted
