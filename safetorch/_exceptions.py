"""Every type safetorch raises or warns with.

Design rules: one `SafetorchWarning` subclass per rule so that users can filter a single rule by category (each is
declared in its check module, beside its `Rule`), and one error type for strict mode. Internal failures of a check
use their own category, which is *not* a finding.
"""

from __future__ import annotations

__all__ = ["SafetorchConfigWarning", "SafetorchError", "SafetorchInternalWarning", "SafetorchWarning"]


class SafetorchWarning(UserWarning):
    """Base class of every safetorch finding. Its message starts with the rule code (``ST001`` ...)."""

    code: str = ""


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
for _cls in (SafetorchWarning, SafetorchError, SafetorchInternalWarning, SafetorchConfigWarning):
    _cls.__module__ = "safetorch"
del _cls
