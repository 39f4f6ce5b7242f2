"""No safetorch frame in the program's tracebacks: an error raised in the forward of an eval-mode model, torch's
errors in patched functions and methods, and strict-mode findings, in this process and in a spawned child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import safetorch
from safetorch import SafetorchError

from .conftest import clean_env, lineno, run_runner

SAFETORCH = os.path.dirname(os.path.abspath(safetorch.__file__)) + os.sep


class _Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(5, 5)  # the program's own error: shapes that do not multiply


def _frames(action: Callable[[], object]) -> tuple[type[BaseException], list[tuple[str, str]]]:
    """The exception ``action`` raises, and its traceback as (file, function) pairs."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - any error is what is looked at
        return type(exc), [(f.filename, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    raise AssertionError("no exception")


_ACTIONS: dict[str, Callable[[], object]] = {
    "eval-mode forward": lambda: nn.Sequential(nn.Linear(3, 3), _Broken()).eval()(torch.randn(2, 3)),
    "eval-mode forward twice": lambda: [_BROKEN_MODEL(torch.randn(2, 3)) for _ in range(2)],
    "tensor conversion": lambda: torch.ones(3).to("no-such-device"),
    "functional dropout": lambda: F.dropout(torch.ones(3), 2.0),
    "loss reduction": lambda: F.mse_loss(torch.ones(3), torch.ones(3), reduction="bad"),
    "backward": lambda: torch.ones(3).sum().backward(),
    "load_state_dict": lambda: nn.Linear(2, 2).load_state_dict({"x": torch.ones(1)}),
    "train": lambda: nn.Linear(2, 2).train("yes"),  # type: ignore[arg-type]
    "module setattr": lambda: setattr(nn.Linear(2, 2), "weight", torch.ones(2)),
}
_BROKEN_MODEL = nn.Sequential(nn.Linear(3, 3), _Broken()).eval()


@pytest.mark.parametrize("name", list(_ACTIONS))
def test_an_error_through_a_patch_shows_the_traceback_it_shows_without_safetorch(name: str) -> None:
    on = _frames(_ACTIONS[name])
    safetorch.uninstall()
    try:
        off = _frames(_ACTIONS[name])
    finally:
        safetorch.install()
    # From 3.11 a bare `raise` adds no frame; on 3.10 it re-raises the traceback it caught, with the patch's frame
    theirs = [frame for frame in on[1] if not frame[0].startswith(SAFETORCH)]
    assert (on[0], theirs) == off
    if sys.version_info >= (3, 11):
        assert on == off


_UNCAUGHT = {
    "eval-mode forward": """\
        import safetorch
        import torch
        import torch.nn as nn

        class Broken(nn.Module):
            def forward(self, x):
                return x @ torch.ones(5, 5)

        model = nn.Sequential(nn.Linear(3, 3), Broken()).eval()
        model(torch.randn(2, 3))
    """,
    "tensor conversion": """\
        import safetorch
        import torch

        def move(x):
            return x.to("no-such-device")

        move(torch.ones(3))
    """,
    "raised from": """\
        import safetorch
        import torch

        try:
            torch.ones(3).to("no-such-device")
        except RuntimeError as error:
            raise ValueError("could not move the batch") from error
    """,
}


@pytest.mark.parametrize("name", list(_UNCAUGHT))
def test_an_uncaught_error_prints_the_traceback_it_prints_without_safetorch(name: str, tmp_path: os.PathLike[str]) \
        -> None:
    """What the user reads when the program dies: the printed traceback is line for line the one without safetorch,
    on every Python. On 3.10 a patch's bare ``raise`` keeps its frame in the exception (above); safetorch's
    excepthook takes it out of what is printed, in the exception and in the one it was raised from."""
    program = os.path.join(tmp_path, "crash.py")
    with open(program, "w") as fh:
        fh.write(textwrap.dedent(_UNCAUGHT[name]))
    printed = {}
    for state, extra in (("on", {}), ("off", {"SAFETORCH_DISABLE": "1"})):
        proc = subprocess.run([sys.executable, program], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=clean_env(**extra))
        assert proc.returncode == 1, proc.stderr
        printed[state] = [line for line in proc.stderr.splitlines() if not line.startswith("safetorch: ")]
    assert printed["on"] == printed["off"]
    assert not [line for line in printed["on"] if SAFETORCH in line]
    assert sum(line.startswith("Traceback") for line in printed["on"]) == (2 if name == "raised from" else 1)


def test_a_strict_finding_shows_no_frame_of_safetorch() -> None:
    safetorch.install(strict=True)
    x = torch.ones(3)
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        x.float()
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(info.value.__traceback__)]
    assert [frame for frame in frames if not frame[0].startswith(SAFETORCH)] == [(__file__, line)]
    if sys.version_info >= (3, 11):  # on 3.10 the conversion's frame stays (see above)
        assert frames == [(__file__, line)]


@pytest.mark.slow
def test_a_strict_finding_in_a_spawned_child_shows_no_frame_of_safetorch(tmp_path: os.PathLike[str]) -> None:
    program = os.path.join(tmp_path, "child.py")
    with open(program, "w") as fh:
        fh.write(textwrap.dedent("""\
            import multiprocessing as mp
            import torch

            def work():
                x = torch.ones(3)
                x.float()

            if __name__ == "__main__":
                mp.set_start_method("spawn")
                p = mp.Process(target=work)
                p.start()
                p.join()
        """))
    proc = run_runner(["--strict", "child.py"], cwd=str(tmp_path))
    assert "safetorch.SafetorchError: ST001 x.float()" in proc.stderr, proc.stderr
    if sys.version_info >= (3, 11):  # on 3.10 the raising frame stays (see above)
        shown = [line.strip() for line in proc.stderr.splitlines() if line.strip().startswith("File ")]
        assert shown[-1] == f'File "{program}", line 6, in work'
        assert not [line for line in shown if SAFETORCH in line]


class _Recursive(nn.Module):
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x if n == 0 else self(x, n - 1)


def _deepest(model: nn.Module) -> int:
    """The first depth at which the model's recursion fails (the recursion limit, lowered to keep the search short)."""
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(400)
    try:
        for n in range(1, 400):
            try:
                model(torch.ones(1), n)
            except RecursionError:
                return n
    finally:
        sys.setrecursionlimit(limit)
    raise AssertionError("no RecursionError")


def test_a_recursive_eval_mode_model_fails_at_the_depth_it_fails_at_without_safetorch() -> None:
    on = _deepest(_Recursive().eval())
    safetorch.uninstall()
    try:
        off = _deepest(_Recursive().eval())
    finally:
        safetorch.install()
    assert on == off
