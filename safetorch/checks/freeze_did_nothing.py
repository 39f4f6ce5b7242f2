"""ST015: a freeze that freezes nothing: ``p.require_grad = False`` (a typo: a new attribute torch never reads) or
``module.requires_grad = False`` (an attribute of the module; ``requires_grad_(False)`` is the method that freezes).
The parameters still require grad, and the optimizer trains what the program meant to keep fixed.

Looked at once per optimizer, when it is built (``Optimizer.__init__`` is wrapped): each parameter it holds is
checked for an attribute spelled like ``requires_grad`` (``require_grad``, ``requires_grads``, ``requiresgrad``...)
set to False while the parameter still requires grad; and each ``nn.Module`` in the caller's local and global
variables (where ``model`` is, in ``SGD(model.parameters())``) is searched for a submodule whose ``__dict__`` holds
``requires_grad`` (or a misspelling) set to False while parameters of it that the optimizer holds still require
grad. A module that stores such a flag and applies it (its parameters do not require grad) stays silent, as do
``module.requires_grad_(False)`` and ``p.requires_grad = False``. Cost: one pass over the parameters per optimizer.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch.nn as nn
from torch.optim import Optimizer

from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, report, user_frame
from .._rule import Rule

CODE = "ST015"


class FreezeDidNothingWarning(SafetorchWarning):
    """ST015: ``p.require_grad = False`` or ``module.requires_grad = False``: an attribute, not a freeze."""

    code = "ST015"


RULE = Rule("ST015", "freeze-did-nothing", FreezeDidNothingWarning,
            "a freeze that freezes nothing (p.require_grad = False, module.requires_grad = False)")


_SPELLINGS = frozenset({"requiresgrad", "requiregrad", "requiresgrads", "requiregrads"})


def _freeze_flag(namespace: dict[str, Any]) -> str | None:
    """The name of an attribute set to False that reads as ``requires_grad``. (On a parameter, ``requires_grad``
    itself is a property of the tensor, never in its ``__dict__``: only a misspelling is found there.)"""
    for name, value in namespace.items():
        if value is False and name.replace("_", "").lower() in _SPELLINGS:
            return name
    return None


def _modules(frame: FrameType) -> list[tuple[str, nn.Module]]:
    """The modules the caller's variables hold, with the variable's name (the first one, locals first)."""
    seen: dict[int, tuple[str, nn.Module]] = {}
    for scope in (frame.f_locals, frame.f_globals):
        for name, value in list(scope.items()):
            if isinstance(value, nn.Module):
                seen.setdefault(id(value), (name, value))
    return list(seen.values())


def _findings(optimizer: Optimizer, frame: FrameType) -> list[str]:
    held = [p for group in optimizer.param_groups for p in group["params"]]
    found: list[str] = []
    typo: dict[str, int] = {}
    for p in held:
        attrs = getattr(p, "__dict__", None)
        if attrs and p.requires_grad:
            name = _freeze_flag(attrs)
            if name is not None:
                typo[name] = typo.get(name, 0) + 1
    for name, count in typo.items():
        found.append(f"`p.{name} = False` on {count} parameter(s) the optimizer holds set an attribute torch never "
                     f"reads: they still require grad and will be trained. Write p.requires_grad = False (or "
                     f"module.requires_grad_(False))")
    ids = {id(p) for p in held}
    reported: set[int] = set()
    for variable, root in _modules(frame):
        for path, module in root.named_modules():
            if id(module) in reported:
                continue
            name = _freeze_flag(module.__dict__)
            if name is None:
                continue
            trained = sum(1 for p in module.parameters() if p.requires_grad and id(p) in ids)
            if trained:
                reported.add(id(module))
                label = f"{variable}.{path}" if path else variable
                found.append(f"`{label}.{name} = False` ({type(module).__name__}) set an attribute of the module, "
                             f"which freezes nothing: {trained} of its parameters the optimizer holds still require "
                             f"grad and will be trained. Write {label}.requires_grad_(False)")
    return found


def _optimizer_init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    __tracebackhide__ = True  # noqa: F841
    result = wrapped(*args, **kwargs)
    try:
        if isinstance(instance, Optimizer):
            frame = user_frame(sys._getframe(1))
            if frame is not None:
                found = _findings(instance, frame)
                if found:  # one site, one finding: both mistakes in one message
                    report(CODE, frame, f"{CODE} " + "; and ".join(found))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)
    return result


def install(registry: Registry) -> None:
    registry.wrap(Optimizer, "__init__", _optimizer_init, CODE)

