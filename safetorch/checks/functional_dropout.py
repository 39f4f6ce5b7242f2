"""ST013: ``F.dropout(x, p)`` in the forward of a module in eval mode: ``training`` defaults to True, so dropout
stays on after ``model.eval()`` and every evaluation is noisy (and lower than it should be).

``F.dropout``, ``F.dropout1d``/``2d``/``3d`` are wrapped. A call that passes ``training`` (positionally or by name)
is never looked at further — ``nn.Dropout`` passes ``self.training``, MC dropout passes ``training=True`` — so a
correct program pays one wrapper per call and nothing else. Without ``training``: when the calling function's first
argument is ``self``, an ``nn.Module`` whose ``training`` is False, and ``p`` is not 0, ST013 at the ``F.dropout``
line. Silent: calls from torch itself (``multi_head_attention_forward`` passes ``training``), a helper function
without ``self`` (not seen: the rule misses it rather than guess), and a module in training mode.
``F.alpha_dropout``'s ``training`` defaults to False: it has the opposite mistake, not this one.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn
import torch.nn.functional as F

from .._callsite import quoted_call
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, is_internal, report
from .._rule import Rule

CODE = "ST013"


class FunctionalDropoutInEvalWarning(SafetorchWarning):
    """ST013: ``F.dropout`` without ``training=`` in the forward of an eval-mode module: dropout stays on."""

    code = "ST013"


RULE = Rule("ST013", "functional-dropout-in-eval", FunctionalDropoutInEvalWarning,
            "F.dropout without training= in the forward of an eval-mode module")

_FUNCTIONS = ("dropout", "dropout1d", "dropout2d", "dropout3d")


def _message(function: str, module: nn.Module, shown: str, method: str) -> str:
    return (f"{CODE} {shown} in {type(module).__name__}.{method}() keeps dropping after .eval(): F.{function}'s "
            f"training= defaults to True whatever the module's mode, so evaluation is noisy and wrong. Pass "
            f"training=self.training (or use nn.{'Dropout' if function == 'dropout' else function.capitalize()})")


def _wrapper(function: str) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True  # noqa: F841
        if len(args) < 3 and "training" not in kwargs:
            try:
                caller = sys._getframe(1)
                code = caller.f_code
                if code.co_argcount and code.co_varnames[0] == "self" and not is_internal(code):
                    module = caller.f_locals.get("self")
                    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
                    # a tensor p is not read (on a device, reading it would make the host wait): such a call is not
                    # looked at
                    if isinstance(module, nn.Module) and not module.training and isinstance(p, (int, float)) \
                            and p != 0:
                        shown = f"F.{function}(...)"
                        report(CODE, caller, lambda: _message(function, module, quoted_call(caller, shown, 80),
                                                              code.co_name))
            except Exception as exc:  # strict-mode findings pass through internal_error
                internal_error(CODE, exc)
        return wrapped(*args, **kwargs)

    return wrapper


def install(registry: Registry) -> None:
    for function in _FUNCTIONS:
        registry.wrap(F, function, _wrapper(function), CODE)
