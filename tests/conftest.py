from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import safetorch
from safetorch import _deferred, _losses, _report
from safetorch.checks import eval_mode_grad, nan_comparison

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Stand-ins for installed libraries (a model hub's loader): code under a ``site-packages`` directory, as a library's.
LIBRARIES = os.path.join(ROOT, "tests", "site-packages")
if LIBRARIES not in sys.path:
    sys.path.insert(0, LIBRARIES)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (torch's corpus, the bench, real frameworks, multi-process "
                          "jobs, a program run many times over): what CI runs")


#: Files whose every test depends on the Python version: bytecode reading, frames and tracebacks, line attribution,
#: the runner and its child processes, dynamo. Marked ``python`` (with single tests marked in other files: TorchScript,
#: annotations), which CI runs on a second Python: ``pytest -m python``.
PYTHON_SENSITIVE = frozenset({
    "test_callsite.py", "test_compiled.py", "test_discarded_conversion.py", "test_discards.py",
    "test_graph_accumulation.py", "test_kept_graphs.py", "test_nan_comparison.py", "test_processes.py",
    "test_raise_path.py", "test_reporter.py", "test_runner.py", "test_suppression.py", "test_tracebacks.py",
    "test_visible.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked slow take most of the suite's time: skipped unless --runslow, so that a plain `python -m pytest`
    is a few minutes. The files of `PYTHON_SENSITIVE` are marked ``python``."""
    for item in items:
        if item.path.name in PYTHON_SENSITIVE:
            item.add_marker(pytest.mark.python)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_safetorch() -> Iterator[None]:
    """Every test starts with all checks installed, not strict, no call site reported yet, and the sampled checks
    counting from the start, as in a new process."""
    safetorch.install(strict=False, ignore=())
    _report.reset()
    eval_mode_grad.reset()
    _losses.reset()
    nan_comparison._state.clear()  # ST021 reads the code of the first backwards' callers: a test's own count
    yield
    _deferred.force_cpu(False)
    safetorch.install(strict=False, ignore=())
    _report.reset()
    eval_mode_grad.reset()


@pytest.fixture
def device_path() -> Iterator[None]:
    """CPU tensors take the accelerator path (`safetorch._deferred`), on a fake device one check behind the host."""
    _deferred.force_cpu(True, lag=1)
    yield
    _deferred.force_cpu(False)


@contextlib.contextmanager
def findings() -> Iterator[list[warnings.WarningMessage]]:
    """Record every SafetorchWarning (and internal warning) raised inside the block. The list is live: read inside
    the block (``assert got == []`` before the line that should report), it holds what was reported so far."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _Findings(caught)
        yield got
        got.sync()
    got.caught = None


class _Findings(list):  # type: ignore[type-arg]
    """The SafetorchWarnings among ``caught`` (a `warnings.catch_warnings` record), brought up to date whenever the
    list is read."""

    def __init__(self, caught: list[warnings.WarningMessage] | None) -> None:
        super().__init__()
        self.caught = caught

    def sync(self) -> None:
        if self.caught is not None:
            mine = [w for w in self.caught
                    if issubclass(w.category, (safetorch.SafetorchWarning, safetorch.SafetorchInternalWarning))]
            list.__setitem__(self, slice(None), mine)

    def __eq__(self, other: object) -> bool:
        self.sync()
        return list.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        self.sync()
        return list.__len__(self)

    def __iter__(self) -> Iterator[warnings.WarningMessage]:
        self.sync()
        return list.__iter__(self)

    def __getitem__(self, index: Any) -> Any:
        self.sync()
        return list.__getitem__(self, index)

    def __contains__(self, item: object) -> bool:
        self.sync()
        return list.__contains__(self, item)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        self.sync()
        return list.__repr__(self)


def on_and_off(program: Callable[[], list[torch.Tensor]]) -> tuple[list[warnings.WarningMessage], bool]:
    """The findings of ``program`` with safetorch on, and whether the tensors it returns are those it gives with
    safetorch off, exactly (the program seeds itself)."""
    with findings() as got:
        on = program()
    safetorch.uninstall()
    try:
        off = program()
    finally:
        safetorch.install()
    return got, len(on) == len(off) and all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone (a file store: no port), for DDP in-process; destroyed after."""
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


PACKAGE = os.path.dirname(os.path.abspath(safetorch.__file__))


def shows_safetorch(text: str) -> bool:
    """Whether ``text`` (a program's stderr) shows safetorch: a line of its own (``safetorch: ...``), a finding
    (``ST004``), or a frame in its package. A path that merely contains the word, such as a virtual environment under
    ``~/.cache/safetorch-ci``, is not safetorch speaking."""
    return PACKAGE in text or re.search(r"^\s*safetorch\b|\bST\d{3}\b", text, re.M) is not None


def lineno() -> int:
    """The line number of the caller: write `statement; line = lineno()` to know the statement's line."""
    return sys._getframe(1).f_lineno


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([ROOT, LIBRARIES, full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=ROOT)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without SAFETORCH_* settings, with the checkout importable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFETORCH_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # MKL's conditional numerical reproducibility: on AVX-512 its kernels may choose a code path by where a buffer
    # lies, so two runs that allocate differently (with safetorch and without) can differ in the last bits of a
    # matmul (seen on an Intel Xeon: a 2-rank DDP job's weights 1e-9 apart). The programs run here compare bits.
    env.setdefault("MKL_CBWR", "COMPATIBLE")
    env.update(extra)
    return env


def run_runner(args: list[str], cwd: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m safetorch *args`` in ``cwd``, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "safetorch", *args], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(**env), timeout=300)
