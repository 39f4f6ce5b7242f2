"""The rule table, derived: every check module under ``safetorch.checks`` declares its rule once (``RULE =
Rule(code, name, warning class, summary, per_rank)``), and this module collects them, ordered by code.

Adding a rule is one check file (its code, its warning class, its `Rule`, its ``install``), one test file and one
docs page: the package's exports, the installer's table, the runner's help and the names ``SAFETORCH_IGNORE``
accepts follow from here. Names are accepted wherever codes are (``SAFETORCH_IGNORE=graph-accumulation``).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from . import checks
from ._rule import Rule

__all__ = ["RULES", "Rule", "resolve", "valid_tokens"]


def _collect() -> dict[str, Rule]:
    found: dict[str, Rule] = {}
    for info in pkgutil.iter_modules(checks.__path__):
        try:
            module = importlib.import_module(f"{checks.__name__}.{info.name}")
        except Exception as exc:  # a torch without an API one check needs must not stop the others
            from ._report import internal_error

            internal_error(info.name, exc, "could not be imported")
            continue
        rule = getattr(module, "RULE", None)
        if isinstance(rule, Rule):
            if rule.code in found:
                raise RuntimeError(f"safetorch: {rule.code} is declared twice ({found[rule.code].module}, {info.name})")
            found[rule.code] = dataclasses.replace(rule, module=info.name)
    return dict(sorted(found.items()))


RULES: dict[str, Rule] = _collect()

_BY_NAME = {r.name: r.code for r in RULES.values()}


def resolve(token: str) -> str | None:
    """Return the code for a code or name (any case), or None when it names no rule."""
    t = token.strip()
    if t.upper() in RULES:
        return t.upper()
    return _BY_NAME.get(t.lower())


def valid_tokens() -> str:
    return ", ".join(f"{r.code} ({r.name})" for r in RULES.values())
