"""safetorch: PyTorch's classic pitfalls caught at the line that makes them. ``import safetorch`` installs every check.

Public surface (design.md): `install`, `uninstall`, `SafetorchWarning` and one subclass per rule,
`SafetorchError`; for scoped and interactive use `ignore`, `findings`, `reset`, `Finding`. Set
``SAFETORCH_DISABLE=1`` to make the import patch nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # the same classes, named for type checkers, which cannot see globals().update (test_typing.py)
    from .checks.clip_scaled_gradients import ClipScaledGradientsWarning as ClipScaledGradientsWarning
    from .checks.ddp_bypassed import DdpBypassedWarning as DdpBypassedWarning
    from .checks.discarded_conversion import DiscardedConversionWarning as DiscardedConversionWarning
    from .checks.empty_cache_loop import EmptyCacheLoopWarning as EmptyCacheLoopWarning
    from .checks.eval_mode_grad import EvalModeGradWarning as EvalModeGradWarning
    from .checks.eval_mode_training import EvalModeTrainingWarning as EvalModeTrainingWarning
    from .checks.evaluation_in_train_mode import EvaluationInTrainModeWarning as EvaluationInTrainModeWarning
    from .checks.freeze_did_nothing import FreezeDidNothingWarning as FreezeDidNothingWarning
    from .checks.functional_dropout import FunctionalDropoutInEvalWarning as FunctionalDropoutInEvalWarning
    from .checks.gradients_accumulate import GradientsAccumulateWarning as GradientsAccumulateWarning
    from .checks.gradients_nobody_uses import GradientsNobodyUsesWarning as GradientsNobodyUsesWarning
    from .checks.graph_accumulation import GraphAccumulationWarning as GraphAccumulationWarning
    from .checks.legacy_reduction import LegacyReductionWarning as LegacyReductionWarning
    from .checks.nan_comparison import NanComparisonWarning as NanComparisonWarning
    from .checks.non_finite_loss import NonFiniteLossWarning as NonFiniteLossWarning
    from .checks.probabilities_into_logits import (
        ProbabilitiesIntoLogitsLossWarning as ProbabilitiesIntoLogitsLossWarning,
    )
    from .checks.replicas_diverged import ReplicasDivergedWarning as ReplicasDivergedWarning
    from .checks.shared_memory import SharedMemoryWarning as SharedMemoryWarning
    from .checks.state_dict_loaded_nothing import StateDictLoadedNothingWarning as StateDictLoadedNothingWarning
    from .checks.step_changed_nothing import StepChangedNothingWarning as StepChangedNothingWarning
    from .checks.step_without_gradients import StepWithoutGradientsWarning as StepWithoutGradientsWarning
    from .checks.volatile_variable import VolatileVariableWarning as VolatileVariableWarning

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


def _started_as_runner() -> bool:
    """``python [options] -m safetorch …`` or the ``safetorch`` console script: the runner installs the checks itself,
    once it knows its script (whose ``pyproject.toml`` counts, not the working directory's)."""
    import os
    import sys

    argv = list(getattr(sys, "orig_argv", []))[1:]
    if argv and os.path.basename(argv[0]) in ("safetorch", "safetorch.exe") and not argv[0].endswith(".py"):
        return True
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] == "safetorch"
        if arg in ("-W", "-X", "--check-hash-based-pycs"):
            i += 2
            continue
        if not arg.startswith("-") or arg == "-c" or arg == "-":
            return False
        i += 1
    return False


def _install_on_import() -> None:
    if _started_as_runner():
        return
    try:
        install()
    except Exception as exc:  # `import safetorch` never raises
        from ._report import internal_error

        internal_error("install", exc)


_install_on_import()
