"""The public surface for scoped and interactive use: `ignore` (a context manager and a decorator), `findings`,
`reset`, `Finding`.

``ignore`` is thread- and task-local: it sets a `contextvars.ContextVar` that `safetorch._report.report_at` reads
when a check is about to report (never on a hot path), so another thread, or another asyncio task, keeps its checks.
A check that reports after the line ran (ST006 on an accelerator reads the loss's value a few steps later; ST010 and
ST011 report at ``optimizer.step()``) is judged by the scope in force when it reports.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from . import _config, _report

__all__ = ["Finding", "findings", "ignore", "reset"]

F = TypeVar("F", bound=Callable[..., Any])


class ignore:  # noqa: N801  (used as a function: `with safetorch.ignore("ST003"):`)
    """Switch rules off for a block or a function, in this thread or task only::

        with safetorch.ignore("ST003"):          # codes or names; none: every rule
            features = frozen_net(images)

        @safetorch.ignore("graph-accumulation")
        def probe(): ...

    An unknown code raises ValueError naming the valid ones. Findings inside are not reported, counted or raised.
    """

    def __init__(self, *rules: str | Iterable[str]) -> None:
        tokens: list[str] = []
        for rule in rules:
            tokens.extend([rule] if isinstance(rule, str) else list(rule))
        if tokens:
            self.codes = _config.parse_ignore_argument(tokens, "safetorch.ignore()")
        else:
            from ._rules import RULES

            self.codes = frozenset(RULES)
        self._tokens: list[contextvars.Token[frozenset[str]]] = []

    def __enter__(self) -> ignore:
        self._tokens.append(_report.scoped_off.set(_report.scoped_off.get() | self.codes))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _report.scoped_off.reset(self._tokens.pop())

    def __call__(self, func: F) -> F:
        codes = self.codes
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                token = _report.scoped_off.set(_report.scoped_off.get() | codes)
                try:
                    return await func(*args, **kwargs)
                finally:
                    _report.scoped_off.reset(token)

            return run_async  # type: ignore[return-value]

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            token = _report.scoped_off.set(_report.scoped_off.get() | codes)
            try:
                return func(*args, **kwargs)
            finally:
                _report.scoped_off.reset(token)

        return run  # type: ignore[return-value]


@dataclass(frozen=True)
class Finding:
    """One call site where a rule fired, as the exit summary lists it."""

    code: str
    name: str
    filename: str
    lineno: int
    message: str
    #: How many times it happened there so far.
    count: int

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}: {self.message}"


def findings() -> list[Finding]:
    """What this process found so far, in order of first occurrence (suppressed lines left out): in a notebook,
    after a cell; in a test, after the code under test."""
    from ._rules import RULES

    return [Finding(s.code, RULES[s.code].name if s.code in RULES else "", s.filename, s.lineno, s.message, s.count)
            for s in _report.findings()]


def reset() -> None:
    """Forget every finding so far: each is reported (warned, raised) again at its next occurrence."""
    _report.reset()
