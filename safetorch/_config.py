"""One `Config`, read once from the environment; explicit `install()` arguments override it.

Design rule: reading the environment never raises. A value that cannot be understood gives one
`SafetorchConfigWarning` and is ignored; an explicit bad argument to `install()` raises `ValueError`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from types import ModuleType

from ._exceptions import SafetorchConfigWarning


def _rules() -> ModuleType:
    """The rule table, imported at first use: it is collected from the check modules, which import the reporter,
    which imports this module."""
    from . import _rules as rules

    return rules


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Config:
    strict: bool = False
    disabled: bool = False
    ignore: frozenset[str] = field(default_factory=frozenset)
    #: True: print the exit summary; False: don't; a string: also write it as JSON to that path.
    report: bool | str = True

    def with_overrides(self, strict: bool | None = None, ignore: Iterable[str] | str | None = None) -> Config:
        cfg = self
        if strict is not None:
            if not isinstance(strict, bool):  # install(strict="false") must not switch strict mode on
                raise ValueError(f"safetorch: strict= takes True, False or None (the environment's "
                                 f"SAFETORCH_STRICT), not {strict!r}")
            cfg = replace(cfg, strict=strict)
        if ignore is not None:
            cfg = replace(cfg, ignore=parse_ignore_argument(ignore))
        return cfg


def _flag(name: str, environ: dict[str, str] | os._Environ[str]) -> bool:
    raw = environ.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        _warn(f"{name}={raw!r} is not understood (use 1 or 0); it is ignored")
    return False


def _warn(message: str) -> None:
    warnings.warn(f"safetorch: {message}", SafetorchConfigWarning, stacklevel=2)


def _split(value: str) -> list[str]:
    return [t for t in value.replace(";", ",").replace(" ", ",").split(",") if t.strip()]


def parse_ignore_argument(ignore: Iterable[str] | str) -> frozenset[str]:
    """Codes or names given to `install(ignore=...)`; an unknown one raises ValueError naming the valid ones."""
    if isinstance(ignore, str):
        tokens = _split(ignore)
    else:
        try:
            tokens = list(ignore)
        except TypeError:
            tokens = [ignore]
    codes = set()
    for token in tokens:
        if not isinstance(token, str):
            raise TypeError(f"safetorch: ignore= takes rule codes or names, as a string ('ST004,ST007') or an "
                            f"iterable of strings, not {type(token).__name__} {token!r}; valid rules are "
                            f"{_rules().valid_tokens()}")
        code = _rules().resolve(token)
        if code is None:
            raise ValueError(f"safetorch: unknown rule {token!r} in ignore=; valid rules are {_rules().valid_tokens()}")
        codes.add(code)
    return frozenset(codes)


def parse_report(raw: str) -> bool | str:
    """SAFETORCH_REPORT: 1 (or empty) prints the exit summary, 0 silences it, anything else is a JSON path."""
    value = raw.strip()
    if value.lower() in _TRUE or value == "":
        return True
    if value.lower() in _FALSE:
        return False
    return value


def from_environ(environ: dict[str, str] | os._Environ[str] | None = None) -> Config:
    """Read the SAFETORCH_* variables. Never raises: bad values warn once each and are ignored."""
    env = os.environ if environ is None else environ
    ignore = set()
    for token in _split(env.get("SAFETORCH_IGNORE", "")):
        code = _rules().resolve(token)
        if code is None:
            _warn(f"SAFETORCH_IGNORE names an unknown rule {token!r}; it is ignored. Valid: {_rules().valid_tokens()}")
        else:
            ignore.add(code)
    report = parse_report(env.get("SAFETORCH_REPORT", "1"))
    return Config(
        strict=_flag("SAFETORCH_STRICT", env),
        disabled=_flag("SAFETORCH_DISABLE", env),
        ignore=frozenset(ignore),
        report=report,
    )


#: The configuration in force: set by `safetorch.install()`, read by the reporter.
current = Config()
