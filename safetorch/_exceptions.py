"""Every type safetorch raises or warns with.

Design rules: one `SafetorchWarning` subclass per rule so that users can filter a single rule by category, and one
error type for strict mode. Internal failures of a check use their own category, which is *not* a finding.
"""

from __future__ import annotations

__all__ = [
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
]


class SafetorchWarning(UserWarning):
    """Base class of every safetorch finding. Its message starts with the rule code (``ST001`` ...)."""

    code: str = ""


class DiscardedConversionWarning(SafetorchWarning):
    """ST001: the result of an out-of-place tensor conversion was discarded."""

    code = "ST001"


class LegacyReductionWarning(SafetorchWarning):
    """ST002: legacy ``size_average``/``reduce`` or ``reduction='elementwise_mean'`` on a loss."""

    code = "ST002"


class EvalModeGradWarning(SafetorchWarning):
    """ST003: an eval-mode forward ran with autograd on, for nothing."""

    code = "ST003"


class GraphAccumulationWarning(SafetorchWarning):
    """ST004: a tensor carrying a graph was accumulated into a Python number."""

    code = "ST004"


class VolatileVariableWarning(SafetorchWarning):
    """ST005: ``Variable(..., volatile=True)`` has no effect since torch 0.4."""

    code = "ST005"


class NonFiniteLossWarning(SafetorchWarning):
    """ST006: a NaN or infinite loss reached ``backward()``."""

    code = "ST006"


class EmptyCacheLoopWarning(SafetorchWarning):
    """ST007: ``torch.cuda.empty_cache()`` called over and over from one line."""

    code = "ST007"


class EvalModeTrainingWarning(SafetorchWarning):
    """ST008: an optimizer trains parameters of a model called in eval mode (dropout off, BatchNorm frozen)."""

    code = "ST008"


class SafetorchError(RuntimeError):
    """Raised instead of a warning in strict mode, and for errors safetorch can explain better than torch.

    ``code``, ``filename`` and ``lineno`` name the finding and the user's line when there is one.
    """

    def __init__(self, message: str, *, code: str | None = None, filename: str | None = None,
                 lineno: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.filename = filename
        self.lineno = lineno


class SafetorchInternalWarning(RuntimeWarning):
    """A check failed internally. The program is unaffected; the check is skipped. Not a finding."""


class SafetorchConfigWarning(UserWarning):
    """An environment variable of safetorch could not be understood and was ignored."""


# Shown as safetorch.SafetorchError (not safetorch._exceptions.SafetorchError) in tracebacks and warnings; pickles
# by that name too, which the package exports.
for _cls in (SafetorchWarning, DiscardedConversionWarning, LegacyReductionWarning, EvalModeGradWarning,
             GraphAccumulationWarning, VolatileVariableWarning, NonFiniteLossWarning, EmptyCacheLoopWarning,
             EvalModeTrainingWarning,
             SafetorchError, SafetorchInternalWarning, SafetorchConfigWarning):
    _cls.__module__ = "safetorch"
del _cls
