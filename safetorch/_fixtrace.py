"""What a run of ``safetorch fix`` saw happen, beyond its findings: the program's own lines that ran, and where each
backward (``backward()``, ``torch.autograd.backward``/``grad``) was called from.

A fix is only as wide as what the run proved. ST003's ``with torch.no_grad():`` may hold a whole evaluation loop only
where no backward ran inside that loop, whatever function it was called through (``train_one_epoch()`` inside an
epoch loop); a finding's line that never ran cannot be fixed from the run, and ``fix`` says so.

Design rules:
- Off unless the runner is started with ``SAFETORCH_FIX_TRACE=<path>`` (by ``safetorch fix`` only); the variable is
  taken out of the environment at once, so that the program's children are not traced.
- Only the program's own files are traced line by line (not torch, wrapt, safetorch, an installed library or the
  standard library): the global trace function answers one cached dict lookup per call elsewhere.
- Written once, at exit, by the process that started it, to the path it was given (JSON, validated when read).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import sysconfig
import threading
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Any

__all__ = ["ENV", "Facts", "read", "recording", "start"]

ENV = "SAFETORCH_FIX_TRACE"

_lines: dict[str, set[int]] = {}
_backwards: set[tuple[tuple[str, int], ...]] = set()
_own: dict[CodeType, str | None] = {}  # code -> its file's absolute path, None for code not the program's


def _excluded_roots() -> tuple[str, ...]:
    roots = {os.path.dirname(os.path.abspath(__file__))}
    for key in ("purelib", "platlib", "stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.realpath(path))
            roots.add(os.path.abspath(path))
    return tuple(r + os.sep for r in roots)


_EXCLUDED: tuple[str, ...] = ()


def _own_file(code: CodeType) -> str | None:
    """The absolute path of the program's own file that ``code`` is in (None for anything else), read when the code
    first runs: before the program changes its working directory."""
    try:
        return _own[code]
    except KeyError:
        pass
    name = code.co_filename
    path = None if name.startswith("<") else os.path.abspath(name)
    if path is not None and (path.startswith(_EXCLUDED) or f"{os.sep}site-packages{os.sep}" in path
                             or f"{os.sep}dist-packages{os.sep}" in path):
        path = None
    _own[code] = path
    return path


def _is_backward(code: CodeType) -> bool:
    return code.co_name in ("backward", "grad") and code.co_filename.endswith(
        os.path.join("torch", "autograd", "__init__.py"))


def _stack(frame: FrameType | None) -> tuple[tuple[str, int], ...]:
    out = []
    while frame is not None:
        path = _own_file(frame.f_code)
        if path is not None:
            out.append((path, frame.f_lineno))
        frame = frame.f_back
    return tuple(out)


def _local(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "line":
        _lines[_own[frame.f_code]].add(frame.f_lineno)  # type: ignore[index]
    return _local


def _global(frame: FrameType, event: str, arg: Any) -> Any:
    code = frame.f_code
    path = _own_file(code)
    if path is not None:
        _lines.setdefault(path, set()).add(frame.f_lineno)
        return _local
    if _is_backward(code):
        _backwards.add(_stack(frame.f_back))
    return None


def start(path: str) -> None:
    """Trace this process from now on, and write what it saw to ``path`` at exit."""
    global _EXCLUDED
    _EXCLUDED = _excluded_roots()
    pid = os.getpid()

    def write() -> None:
        sys.settrace(None)
        if os.getpid() != pid:
            return
        data = {"lines": {f: sorted(n) for f, n in _lines.items()},
                "backwards": [list(map(list, s)) for s in _backwards]}
        try:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(data, fh)
        except OSError:
            pass

    atexit.register(write)
    threading.settrace(_global)
    sys.settrace(_global)


@contextlib.contextmanager
def recording() -> Iterator[Facts]:
    """Record what runs in this thread inside the block, as `start` does for a whole process (the facts are filled
    in when the block ends)."""
    global _EXCLUDED
    _EXCLUDED = _excluded_roots()
    _lines.clear()
    _backwards.clear()
    facts = Facts({}, [])
    previous = sys.gettrace()
    sys.settrace(_global)
    try:
        yield facts
    finally:
        sys.settrace(previous)
        facts.lines = {f: set(n) for f, n in _lines.items()}
        facts.backwards = list(_backwards)
        _lines.clear()
        _backwards.clear()


class Facts:
    """What `start` wrote: lines that ran, per file, and the program's own (file, line) frames of each backward."""

    def __init__(self, lines: dict[str, set[int]], backwards: list[tuple[tuple[str, int], ...]]) -> None:
        self.lines = lines
        self.backwards = backwards

    def ran(self, path: str, line: int) -> bool:
        return line in self.lines.get(path, ())

    def file_ran(self, path: str) -> bool:
        return path in self.lines

    def backward_within(self, path: str, first: int, last: int) -> bool:
        """Whether a backward ran while a line from ``first`` to ``last`` of ``path`` was executing (itself, or a
        function it called)."""
        return any(p == path and first <= n <= last for stack in self.backwards for p, n in stack)


def read(path: str) -> Facts | None:
    """The facts written to ``path``, validated field by field; None when there are none."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    lines: dict[str, set[int]] = {}
    for name, numbers in (data.get("lines") or {}).items():
        if isinstance(name, str) and isinstance(numbers, list):
            lines[os.path.normpath(name)] = {n for n in numbers if type(n) is int}
    backwards = []
    for stack in data.get("backwards") or []:
        if isinstance(stack, list):
            backwards.append(tuple((os.path.normpath(p), n) for p, n in (
                item for item in stack if isinstance(item, list) and len(item) == 2)
                if isinstance(p, str) and type(n) is int))
    return Facts(lines, backwards)
