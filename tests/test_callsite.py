"""The call-site reader on every Python 3.10-3.13 this machine has: discarded results and accumulations."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import types
from typing import Any

import pytest

from safetorch._callsite import fills

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
    proc = subprocess.run([exe, PROBE], capture_output=True, text=True, timeout=300)
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
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["used", "1", "discarded"]


@pytest.mark.parametrize(("source", "shown"), [
    ("x.to(\n    torch.float64,\n)", "x.to(torch.float64)"),  # a call over several lines, with its trailing comma
    ("x.to( torch.float64, )", "x.to(torch.float64)"),
    ("x.to(  # the loss wants doubles\n    dtype=torch.float64,\n    copy=True,\n)",
     "x.to(dtype=torch.float64, copy=True)"),
    ('d["a"].float()', 'd["a"].float()'),  # the user's quotes, which ast.unparse would rewrite
    ("F.dropout(self.fc(x), 0.5)", "F.dropout(self.fc(x), 0.5)"),
    ("lambda t: t.float() + 1", "lambda t: t.float() + 1"),
    ("x[1:2, ::3].to(\n    'cpu')", "x[1:2, ::3].to('cpu')"),
    ("f(a\n  + b)", "f(a + b)"),
    ("[a,\n b,\n]", "[a, b]"),
    ("(a,)", "(a,)"),  # a tuple's one comma stays, as does a subscript's (`t[i,]` is `t[(i,)]`)
    ("t[i,]", "t[i,]"),
    ("t[i, j,]", "t[i, j]"),
    ('f"{x!r} {{y}}".format(\n    z,\n)', 'f"{x!r} {{y}}".format(z)'),
    ("unbalanced(", "unbalanced("),
])
def test_normalized_quotes_source_on_one_line_as_written(source: str, shown: str) -> None:
    from safetorch._callsite import normalized

    assert normalized(source) == shown


class _Probe:
    """Stands for a tensor: its ``float()`` records what `method_call` reads of the line that called it."""

    seen: list[tuple[str | None, str | None]] = []

    def float(self) -> None:
        from safetorch._callsite import method_call

        _Probe.seen.append(method_call(sys._getframe(1), "float", 0, assignable=True))


def test_method_call_names_a_receiver_a_fix_can_assign_to() -> None:
    """A name, an attribute chain, an item of a dict or list by constant or name key: ``<receiver> = <call>`` can
    be written. A call's result, an item of a tuple, an item by a computed key: nothing to assign to."""
    p, d, xs, pair, i = _Probe(), {"a": _Probe()}, [_Probe(), _Probe()], (_Probe(),), 1
    holder = types.SimpleNamespace(items={"k": _Probe()}, p=_Probe())

    def make() -> _Probe:
        return p

    _Probe.seen.clear()
    p.float()
    d["a"].float()
    xs[0].float()
    xs[-1].float()
    xs[i].float()
    holder.items["k"].float()
    holder.p.float()
    make().float()
    pair[0].float()
    d["".join("a")].float()
    assert [receiver for receiver, _ in _Probe.seen] == [
        "p", 'd["a"]', "xs[0]", "xs[-1]", "xs[i]", 'holder.items["k"]', "holder.p", None, None, None]
    assert [call for _, call in _Probe.seen][-3:] == ["make().float()", "pair[0].float()", 'd["".join("a")].float()']


def test_fills_names_the_first_line_that_puts_into_a_holder() -> None:
    def train(self: Any, loader: Any) -> None:
        losses: list[Any] = []
        history: dict[Any, Any] = {}
        total = 0
        for i, x in enumerate(loader):
            losses.append(x)
            history[i] = x
            total += x
            self.outputs.append(x)
            self.running += x
            self.by_step[i] = x

    first = train.__code__.co_firstlineno
    found = {name: fills(train.__code__, name) for name in
             ("losses", "history", "total", "self.outputs", "self.running", "self.by_step", "x", "i")}
    assert found == {"losses": first + 5, "history": first + 6, "total": first + 7, "self.outputs": first + 8,
                     "self.running": first + 9, "self.by_step": first + 10, "x": None, "i": None}
