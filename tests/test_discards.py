"""ST001's methods on Python 3.10 and 3.11 (`safetorch._discards`): patched only once the program's code throws a
call of theirs away, so that a forward's shape calls and torch's own conversions stay torch's methods, and every
discarded call the program makes is still found, wherever its code was loaded from."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from safetorch import _discards

from .conftest import clean_env

ONLY_311 = pytest.mark.skipif(not _discards.AVAILABLE, reason="3.12+ watches with sys.monitoring (safetorch._monitor)")

WATCHED = frozenset({"view", "cpu", "to", "float", "transpose", "cuda"})


def _names(source: str) -> set[str]:
    code = compile(textwrap.dedent(source), "<test>", "exec")
    function = next(c for c in code.co_consts if hasattr(c, "co_code"))
    return _discards.discarded_names(function, WATCHED)


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``cwd``, with the checkout importable and no setting of safetorch's."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=clean_env(),
                          timeout=120)


@ONLY_311
@pytest.mark.parametrize(("source", "expected"), [
    ("def f(x):\n    x.view(2, 8)\n", {"view"}),
    ("def f(x):\n    torch.Tensor.view(x, 6)\n", {"view"}),
    ("def f(x):\n    x.to(*x)\n    x.float(non_blocking=True)\n", {"to", "float"}),
    ("def f(x):\n    getattr(x, 'cpu')()\n", set(WATCHED)),
    ("def f(x):\n    g = x.cpu\n    g()\n", {"cpu"}),
    ("def f(x, cond):\n    x.to(1 if cond else 2)\n", {"to"}),  # a jump in the arguments: the names it mentions
], ids=["method", "through-class", "star-and-keywords", "getattr", "bound-method", "jump"])
def test_a_statement_that_throws_a_call_away_asks_for_its_method(source: str, expected: set[str]) -> None:
    assert _names(source) == expected


@ONLY_311
@pytest.mark.parametrize("source", [
    "def f(x):\n    y = x.view(2, 8)\n    return x.to(y).float()\n",  # every result used
    "def f(x, criterion, y, optimizer):\n    b = x.to(1)\n    criterion(b, y)\n    optimizer.step()\n    print(b)\n",
    "def f(x, a):\n    a.append(x.cpu())\n",  # the result kept in a list; the append's thrown away
], ids=["used", "other-callees", "argument"])
def test_a_statement_that_throws_away_another_call_asks_for_nothing(source: str) -> None:
    assert _names(source) == set()


_FORWARD = """
import sys
import torch
import safetorch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1)).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(b, t, c).float().to(x.dtype)

model = torch.nn.Sequential(Block(), torch.nn.Linear(8, 1))
x = torch.randn(2, 4, 8, dtype=torch.float64)

def step():
    loss = model(x.float()).pow(2).mean()
    loss.backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)

step()
own = safetorch.__file__.rsplit("/", 1)[0]
entered = []

def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(own):
        entered.append(frame.f_code.co_filename.rsplit("/", 1)[1] + ":" + frame.f_code.co_name)

sys.setprofile(profile)
norms = [step() for _ in range(3)]
sys.setprofile(None)
mine = [e for e in entered if e.split(":")[0] in ("discarded_conversion.py", "_callsite.py", "_monitor.py",
                                                 "_discards.py")]
torch_own = [name for name in ("view", "transpose", "reshape", "permute", "to", "float")
             if getattr(torch.Tensor, name) is not getattr(torch._C.TensorBase, name)]
print("entered", mine, "patched", torch_own, "finite", all(torch.isfinite(n) for n in norms))
"""


def test_a_forward_s_shape_calls_and_torch_s_own_conversions_never_enter_safetorch(tmp_path: Path) -> None:
    """On every Python: ``view``/``transpose``/``reshape`` in a forward, ``x.float()`` whose result is used and the
    ``.to()`` that ``clip_grad_norm_`` makes once per parameter run torch's own methods (a profiler count)."""
    script = tmp_path / "train.py"
    script.write_text(_FORWARD)
    proc = _run(tmp_path, str(script))
    assert proc.returncode == 0, proc.stderr
    assert "entered [] patched [] finite True" in proc.stdout, proc.stdout + proc.stderr
    assert "ST001" not in proc.stderr


_BEFORE = """\
import torch

def before(x):
    x.float()
"""
_AFTER = """\
def after(x):
    x.t()
"""
_MAIN = """\
import torch
import before
import safetorch
import after

x = torch.ones(2, 2, dtype=torch.float64)

def train(criterion, y):
    for _ in range(2):
        criterion(x.to(torch.float32), y)
        x.view(4)
        f = x.transpose
        f(0, 1)

train(lambda a, b: None, None)
before.before(x)
after.after(x)
print("to is torch's", torch.Tensor.to is torch._C.TensorBase.to)
"""


def _program(tmp_path: Path) -> Path:
    (tmp_path / "before.py").write_text(_BEFORE)
    (tmp_path / "after.py").write_text(_AFTER)
    script = tmp_path / "main.py"
    script.write_text(_MAIN)
    return script


def _found(stderr: str, tmp_path: Path) -> list[tuple[str, int]]:
    found = []
    for line in stderr.splitlines():
        if ": DiscardedConversionWarning: ST001" in line:
            where = line.split(": DiscardedConversionWarning")[0]
            filename, lineno = where.rsplit(":", 1)
            found.append((str(Path(filename).relative_to(tmp_path)), int(lineno)))
    return sorted(found)


EXPECTED = [("after.py", 2), ("before.py", 4), ("main.py", 11), ("main.py", 13)]


def test_discarded_calls_are_found_in_the_script_and_in_modules_imported_before_and_after_safetorch(
        tmp_path: Path) -> None:
    script = _program(tmp_path)
    proc = _run(tmp_path, str(script))
    assert proc.returncode == 0, proc.stderr
    assert _found(proc.stderr, tmp_path) == EXPECTED, proc.stderr
    if _discards.AVAILABLE:  # the closure's discarded ``criterion(...)`` asks for no patch of ``.to``
        assert "to is torch's True" in proc.stdout


@pytest.mark.parametrize("how", ["script", "module"])
def test_discarded_calls_are_found_in_a_program_the_runner_starts(tmp_path: Path, how: str) -> None:
    """``python -m safetorch main.py`` and ``python -m safetorch -m main``: safetorch is installed before any code of
    the program runs, which the runner (a script) or runpy (a module) executes."""
    script = _program(tmp_path)
    command = [str(script)] if how == "script" else ["-m", "main"]
    proc = _run(tmp_path, "-m", "safetorch", "--exit-zero", *command)
    assert proc.returncode == 0, proc.stderr
    assert _found(proc.stderr, tmp_path) == EXPECTED, proc.stderr


def test_an_error_in_a_module_imported_after_safetorch_shows_no_frame_of_safetorch(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import torch\n\n\ndef f(x):\n    x.view(4)\n\n\nraise ValueError('boom')\n")
    (tmp_path / "main.py").write_text("import safetorch\nimport broken\n")
    proc = _run(tmp_path, "main.py")
    assert proc.returncode == 1
    trace = proc.stderr[proc.stderr.index("Traceback"):]
    assert [line.strip() for line in trace.splitlines() if line.strip().startswith("File")] == [
        f'File "{tmp_path / "main.py"}", line 2, in <module>', f'File "{tmp_path / "broken.py"}", line 8, in <module>']
    assert trace.rstrip().endswith("ValueError: boom")


def test_a_notebook_cell_s_discarded_call_is_found() -> None:
    """IPython runs a cell with its own ``exec``: on 3.10/3.11 the cell's code is read there."""
    pytest.importorskip("IPython")
    program = textwrap.dedent("""
        import warnings
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_cell("import torch, safetorch\\nx = torch.ones(2, 3)")
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            shell.run_cell("y = x + 1\\nx.view(3, 2)\\nx.t();")
        print(sorted((w.category.__name__, w.lineno) for w in got))
    """)
    proc = _run(Path.cwd(), "-c", program)
    assert proc.returncode == 0, proc.stderr
    assert "[('DiscardedConversionWarning', 2), ('DiscardedConversionWarning', 3)]" in proc.stdout, \
        proc.stdout + proc.stderr


@ONLY_311
def test_a_with_block_s_exit_and_a_closure_s_call_ask_for_nothing() -> None:
    """The worst-case bench's loop: ``criterion(model(x), y)`` under ``no_grad`` throws two calls away, a closure's
    and the ``with`` block's ``__exit__``; neither is a tensor method, though the code converts with ``.to()``."""
    source = ("def make(criterion, model, x, y, torch):\n"
              "    def epoch():\n"
              "        with torch.no_grad():\n"
              "            criterion(model(x), y)\n"
              "        batch = x.to(torch.float32).float()\n"
              "        return batch\n"
              "    return epoch\n")
    make = next(c for c in compile(source, "<test>", "exec").co_consts if hasattr(c, "co_code"))
    epoch = next(c for c in make.co_consts if hasattr(c, "co_code"))
    assert _discards.discarded_names(epoch, WATCHED) == set()


def test_a_nan_check_in_a_helper_no_backward_passes_through_is_found(tmp_path: Path) -> None:
    """ST021 reads a function where it meets it: on 3.12+ as it starts; on 3.10/3.11 at the first call of a patched
    method in it, so a method that a function naming a NaN calls is patched (here ``.float()``, whose result is used).
    """
    script = tmp_path / "main.py"
    script.write_text("import torch\nimport safetorch\n\n\ndef check(x):\n    y = x.float()\n"
                      "    if y.sum().item() == float('nan'):\n        print('never')\n\n\ncheck(torch.ones(2))\n"
                      "print('view is torch s', torch.Tensor.view is torch._C.TensorBase.view)\n")
    proc = _run(tmp_path, str(script))
    assert proc.returncode == 0, proc.stderr
    assert f"{script}:7: NanComparisonWarning: ST021 " in proc.stderr, proc.stderr
    assert "view is torch s True" in proc.stdout
