"""ST005: ``Variable(x, volatile=True)``, which has done nothing since torch 0.4.

Old validation loops relied on it to switch autograd off (the first seed post did, and ran out of memory). Torch
ignores the argument with a warning that says nothing about where; safetorch reports the user's line with the fix
and drops the argument, so torch's warning is not repeated. ``Variable`` is built by its metaclass's ``__call__``,
which is wrapped on that metaclass alone: ``isinstance(x, Variable)`` and every other class are untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._patch import Registry, caller
from .._report import internal_error, is_internal, report
from .._rule import Rule

CODE = "ST005"


class VolatileVariableWarning(SafetorchWarning):
    """ST005: ``Variable(..., volatile=True)`` has no effect since torch 0.4."""

    code = "ST005"


RULE = Rule("ST005", "volatile-variable", VolatileVariableWarning,
            "Variable(..., volatile=True), which has no effect since torch 0.4")
_VOLATILE_POSITION = 2  # Variable(data, requires_grad, volatile, ...)

MESSAGE = (f"{CODE} Variable(..., volatile=True) has no effect since torch 0.4: autograd still records the graph "
           f"of everything computed from it. Write: `with torch.no_grad():` around the code that must not record "
           f"(and use the tensor itself: Variable is no longer needed)")


def _call(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    __tracebackhide__ = True  # noqa: F841
    try:
        if "volatile" in kwargs or len(args) > _VOLATILE_POSITION:
            volatile = kwargs.get("volatile", args[_VOLATILE_POSITION] if len(args) > _VOLATILE_POSITION else None)
            frame = caller()
            if volatile and not is_compiling() and not is_internal(frame.f_code):
                report(CODE, frame, MESSAGE)
                kwargs = {k: v for k, v in kwargs.items() if k != "volatile"}
                args = args[:_VOLATILE_POSITION] + (False,) + args[_VOLATILE_POSITION + 1:] \
                    if len(args) > _VOLATILE_POSITION else args
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)
    return wrapped(*args, **kwargs)


def install(registry: Registry) -> None:
    # torch.autograd.variable is shadowed by a function of that name: reach the metaclass through the class.
    registry.wrap(type(torch.autograd.Variable), "__call__", _call, CODE)
