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

#: The scopes entered in this context, innermost last (their tokens of `_report.scoped_off`).
_entered: contextvars.ContextVar[tuple[contextvars.Token[frozenset[str]], ...]] = contextvars.ContextVar(
    "safetorch_ignore_entered", default=())


class ignore:  # noqa: N801  (used as a function: `with safetorch.ignore("ST003"):`)
    """Switch rules off for a block or a function, in this thread or task only::

        with safetorch.ignore("ST003"):          # codes or names; none: every rule
            features = frozen_net(images)

        @safetorch.ignore("graph-accumulation")
        def probe(): ...

    An unknown code raises ValueError naming the valid ones. Findings inside are not reported, counted or raised.
    A generator function cannot be decorated (its body runs after the call returned): use ``with`` inside it,
    around code that does not yield — a scope that is open across a ``yield`` covers the caller's code while the
    generator waits (contextvars follow the thread, not the generator).
    """

    def __init__(self, *rules: str | Iterable[str]) -> None:
        tokens: list[str] = []
        for rule in rules:
            tokens.extend(_config._split(rule) if isinstance(rule, str) else list(rule))
        if rules:  # ignore("ST001,ST003"), ignore(["ST001"]); an empty list names no rule
            self.codes = _config.parse_ignore_argument(tokens, "safetorch.ignore()")
            if not self.codes:
                raise ValueError("safetorch: safetorch.ignore() got no rule; call it without arguments for every rule")
        else:
            from ._rules import RULES

            self.codes = frozenset(RULES)

    def __enter__(self) -> ignore:
        # The token goes on a stack of the current context: one `ignore` object may be entered in several threads.
        _entered.set((*_entered.get(), _report.scoped_off.set(_report.scoped_off.get() | self.codes)))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        stack = _entered.get()
        _entered.set(stack[:-1])
        _report.scoped_off.reset(stack[-1])

    def __call__(self, func: F) -> F:
        codes = self.codes
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            # Its body runs at each next(), after a decorator's scope would have ended; a scope held across its
            # yields would cover the caller's code instead.
            raise TypeError(f"safetorch.ignore() cannot decorate the generator function {func.__qualname__}: write "
                            "`with safetorch.ignore(...):` inside it, around the code between its yields")
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
