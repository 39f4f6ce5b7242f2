"""The call-site reader on every Python 3.10-3.13 this machine has: discarded results and accumulations."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "callsite_probe.py")

EXPECTED = {
    "m.discarded": True, "m.assigned": False, "m.comprehension": False, "m.argument": False,
    "m.conditional": False, "m.lambda": False,
    "m.iadd": True, "m.add_same_name": True, "m.plain_add": False, "m.scaled": False, "m.other_name": False,
    "f.discarded": True, "f.assigned": False, "f.chained": False, "f.comprehension": False, "f.argument": False,
    "f.conditional": False, "f.returned": False,
    "f.iadd": True, "f.add_same_name": True, "f.add_same_name_int": True, "f.plain_add": False,
    "f.other_name": False, "f.scaled": False, "f.one_line_add": True, "f.chained_store_add": True,
    "k.key_function": False, "k.method_call": True,
}



def _find(minor: int) -> str | None:
    # pyenv installs (and their shims, which fail when the version is not selected) are looked up directly.
    found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/python3.{minor}")))
    return found[-1] if found else shutil.which(f"python3.{minor}")


INTERPRETERS = {f"3.{minor}": _find(minor) for minor in (10, 11, 12, 13)}
INTERPRETERS[f"{sys.version_info[0]}.{sys.version_info[1]}"] = sys.executable


@pytest.mark.parametrize("version", sorted(INTERPRETERS))
def test_reader_on_every_python(version: str) -> None:
    exe = INTERPRETERS[version]
    if exe is None:
        pytest.skip(f"python{version} is not installed here")
    proc = subprocess.run([exe, PROBE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["version"] == [int(p) for p in version.split(".")]
    assert out["results"] == EXPECTED


def test_interactive_echo_is_not_a_discard() -> None:
    # The REPL compiles an expression statement in "single" mode: its value is printed, not popped.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cs', {os.path.join(os.path.dirname(PROBE), '..', 'safetorch', '_callsite.py')!r})\n"  # noqa: E501
        "cs = importlib.util.module_from_spec(spec); spec.loader.exec_module(cs)\n"
        "def probe():\n    print('discarded' if cs.is_discarded(sys._getframe(1)) else 'used'); return 1\n"
        "exec(compile('probe()', '<stdin>', 'single'))\n"
        "exec(compile('probe()', '<stdin>', 'exec'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["used", "1", "discarded"]
