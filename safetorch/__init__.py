"""safetorch: PyTorch's classic pitfalls caught at the line that makes them. ``import safetorch`` installs every check.

Public surface (design.md): `install`, `uninstall`, `SafetorchWarning` and one subclass per rule,
`SafetorchError`. Set ``SAFETORCH_DISABLE=1`` to make the import patch nothing.
"""

from __future__ import annotations

from . import functional as functional
from . import nn as nn
from ._exceptions import DiscardedConversionWarning as DiscardedConversionWarning
from ._exceptions import EmptyCacheLoopWarning as EmptyCacheLoopWarning
from ._exceptions import EvalModeGradWarning as EvalModeGradWarning
from ._exceptions import EvalModeTrainingWarning as EvalModeTrainingWarning
from ._exceptions import GraphAccumulationWarning as GraphAccumulationWarning
from ._exceptions import LegacyReductionWarning as LegacyReductionWarning
from ._exceptions import NonFiniteLossWarning as NonFiniteLossWarning
from ._exceptions import SafetorchConfigWarning as SafetorchConfigWarning
from ._exceptions import SafetorchError as SafetorchError
from ._exceptions import SafetorchInternalWarning as SafetorchInternalWarning
from ._exceptions import SafetorchWarning as SafetorchWarning
from ._exceptions import VolatileVariableWarning as VolatileVariableWarning
from ._install import install as install
from ._install import installed_checks as installed_checks
from ._install import uninstall as uninstall
from ._rules import RULES as RULES


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("safetorch")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "RULES",
    "DiscardedConversionWarning",
    "EmptyCacheLoopWarning",
    "EvalModeGradWarning",
    "EvalModeTrainingWarning",
    "GraphAccumulationWarning",
    "LegacyReductionWarning",
    "NonFiniteLossWarning",
    "SafetorchConfigWarning",
    "SafetorchError",
    "SafetorchInternalWarning",
    "SafetorchWarning",
    "VolatileVariableWarning",
    "functional",
    "install",
    "installed_checks",
    "nn",
    "uninstall",
]


def _install_on_import() -> None:
    try:
        install()
    except Exception as exc:  # `import safetorch` never raises
        from ._report import internal_error

        internal_error("install", exc)


_install_on_import()
