"""safetorch: PyTorch's classic pitfalls caught at the line that makes them. ``import safetorch`` installs every check.

Public surface (design.md): `install`, `uninstall`, `SafetorchWarning` and one subclass per rule,
`SafetorchError`; for scoped and interactive use `ignore`, `findings`, `reset`, `Finding`. Set
``SAFETORCH_DISABLE=1`` to make the import patch nothing.
"""

from __future__ import annotations

from . import functional as functional
from . import nn as nn
from ._exceptions import SafetorchConfigWarning as SafetorchConfigWarning
from ._exceptions import SafetorchError as SafetorchError
from ._exceptions import SafetorchInternalWarning as SafetorchInternalWarning
from ._exceptions import SafetorchWarning as SafetorchWarning
from ._install import install as install
from ._install import installed_checks as installed_checks
from ._install import uninstall as uninstall
from ._rules import RULES as RULES
from ._scoped import Finding as Finding
from ._scoped import findings as findings
from ._scoped import ignore as ignore
from ._scoped import reset as reset


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("safetorch")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


__version__ = _version()

# One warning class per rule, declared by its check beside its `Rule`: exported from the rule table, so that a new
# rule touches no file here (``safetorch.EvalModeGradWarning``, ``warnings.filterwarnings(..., category=...)``).
_RULE_WARNINGS = {rule.category.__name__: rule.category for rule in RULES.values()}
globals().update(_RULE_WARNINGS)

__all__ = [
    "RULES",
    "Finding",
    "SafetorchConfigWarning",
    "SafetorchError",
    "SafetorchInternalWarning",
    "SafetorchWarning",
    *sorted(_RULE_WARNINGS),
    "findings",
    "functional",
    "ignore",
    "install",
    "installed_checks",
    "nn",
    "reset",
    "uninstall",
]


def _install_on_import() -> None:
    try:
        install()
    except Exception as exc:  # `import safetorch` never raises
        from ._report import internal_error

        internal_error("install", exc)


_install_on_import()
