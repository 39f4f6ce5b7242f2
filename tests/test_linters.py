"""`import safetorch` binds a name the script never uses: linters call it unused (F401) and `ruff check --fix` deletes
it. The import as the docs show it (`import safetorch  # noqa: F401`), and the explicit `safetorch.install()` form,
survive the fix; the examples keep whatever they import."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

IMPORT = re.compile(r"^import safetorch\b.*$", re.M)


def _ruff() -> list[str]:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    binary = shutil.which("ruff")
    if binary is None:
        pytest.skip("ruff is not installed")
    return [binary]


def _fix_unused_imports(directory: Path) -> None:
    """What a user's `ruff check --fix` does to unused imports, whatever this project's own ruff settings."""
    proc = subprocess.run([*_ruff(), "check", "--fix", "--select", "F401", "--isolated", "--no-cache", "."],
                          capture_output=True, text=True, cwd=directory, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _documented_snippets() -> list[str]:
    """The Python blocks of the README and docs/ that import safetorch, as a user copies them."""
    pages = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                recursive=True))]
    snippets = []
    for page in pages:
        with open(page) as fh:
            snippets += [block for block in re.findall(r"```python\n(.*?)```", fh.read(), re.S) if IMPORT.search(block)]
    return snippets


def test_the_import_as_documented_survives_ruff_fix(tmp_path: Path) -> None:
    shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples")
    for n, snippet in enumerate(_documented_snippets()):
        (tmp_path / f"snippet_{n}.py").write_text(snippet)
    before = {path: IMPORT.findall(path.read_text()) for path in sorted(tmp_path.rglob("*.py"))}
    assert any(path.name.startswith("snippet_") for path, lines in before.items() if lines), "no import documented"
    assert all("# noqa: F401" in line for lines in before.values() for line in lines), before
    _fix_unused_imports(tmp_path)
    after = {path: IMPORT.findall(path.read_text()) for path in before}
    assert after == before


def test_the_explicit_install_survives_ruff_fix(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import safetorch\n\nsafetorch.install()\n")
    _fix_unused_imports(tmp_path)
    assert script.read_text() == "import safetorch\n\nsafetorch.install()\n"


def test_without_the_noqa_comment_ruff_fix_deletes_the_import(tmp_path: Path) -> None:
    """Why the docs write the comment: the same fix removes the bare import."""
    script = tmp_path / "train.py"
    script.write_text("import safetorch\nimport torch\n\nprint(torch.ones(1))\n")
    _fix_unused_imports(tmp_path)
    assert script.read_text() == "import torch\n\nprint(torch.ones(1))\n"
