"""ST013: ``F.dropout(x, p)`` in the forward of a module in eval mode: ``training`` defaults to True, so dropout
stays on after ``model.eval()`` and every evaluation is noisy (and lower than it should be).

``F.dropout``, ``F.dropout1d``/``2d``/``3d`` are replaced by plain functions with torch's signature. A call that passes
``training`` (positionally or by name) is never looked at further — ``nn.Dropout`` passes ``self.training``, MC dropout
passes ``training=True`` — so a correct program pays one plain call per ``F.dropout`` and nothing else. Without
``training``: when the calling function's first argument is ``self``, an ``nn.Module`` whose ``training`` is False, and
``p`` is not 0 (a number: a tensor ``p`` is not read), ST013 at the ``F.dropout`` line. Silent: calls from torch itself
(``multi_head_attention_forward`` passes ``training``), a helper function without ``self`` (not seen: the rule misses it
rather than guess), and a module in training mode.
``F.alpha_dropout``'s ``training`` defaults to False: it has the opposite mistake, not this one.
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any

import torch.nn as nn
import torch.nn.functional as F

from .._callsite import quoted_call
from .._exceptions import SafetorchWarning
from .._patch import Registry, with_globals_of
from .._report import internal_error, is_internal, report
from .._rule import Rule
from .._tracebacks import hide_own_frames

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


_UNSET: Any = object()  # ``training`` not passed: what the rule looks for
_PARAMETERS = ("input", "p", "training", "inplace")


def _look(function: str, caller: FrameType, p: Any) -> None:
    """``F.<function>`` was called without ``training``: is its caller the forward of an eval-mode module?"""
    __tracebackhide__ = True  # noqa: F841
    try:
        code = caller.f_code
        if code.co_argcount and code.co_varnames[0] == "self" and not is_internal(code):
            module = caller.f_locals.get("self")
            # a tensor p is not read (on a device, reading it would make the host wait): such a call is not looked at
            if isinstance(module, nn.Module) and not module.training and isinstance(p, (int, float)) and p != 0:
                shown = f"F.{function}(...)"
                report(CODE, caller, lambda: _message(function, module, quoted_call(caller, shown, 80), code.co_name))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _replacement(function: str) -> Any:
    """A plain function with torch's signature, not a wrapt proxy: ``nn.Dropout`` calls it at every forward, and
    it pays one call (torch's function called with a plain positional call) and one identity test. TorchScript
    compiles what a scripted forward calls from its source (torch's, through ``__wrapped__``) and resolves its names
    in the function's globals and closure: the replacement has torch's globals, and reaches its own helpers through
    its closure only (`safetorch._patch.with_globals_of`)."""

    def factory(original: Any) -> Any:
        look, getframe, unset, hide = _look, sys._getframe, _UNSET, hide_own_frames
        if tuple(inspect.signature(original).parameters) != _PARAMETERS:

            def dropout_any(*args: Any, **kwargs: Any) -> Any:  # a torch with other parameters than the known ones
                __tracebackhide__ = True  # noqa: F841
                try:
                    if len(args) < 3 and "training" not in kwargs:
                        look(function, getframe(1), args[1] if len(args) > 1 else kwargs.get("p", 0.5))
                    return original(*args, **kwargs)
                except BaseException as exc:  # no frame of ours in the traceback of what passes through
                    hide(exc)
                    raise

            return with_globals_of(original, dropout_any)

        def dropout(input: Any, p: Any = 0.5, training: Any = unset, inplace: Any = False) -> Any:
            __tracebackhide__ = True  # noqa: F841
            try:
                if training is unset:
                    training = True
                    look(function, getframe(1), p)
                return original(input, p, training, inplace)
            except BaseException as exc:  # no frame of ours in the traceback of what passes through
                hide(exc)
                raise

        return with_globals_of(original, dropout)

    return factory


def install(registry: Registry) -> None:
    for function in _FUNCTIONS:
        registry.replace(F, function, _replacement(function), CODE)
