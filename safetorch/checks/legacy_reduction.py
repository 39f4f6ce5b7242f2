"""ST002: legacy ``size_average``/``reduce`` or ``reduction='elementwise_mean'`` converted to ``reduction=``.

Every loss class and every functional loss of torch converts its legacy arguments through the same two helpers
of ``torch.nn._reduction``: ``legacy_get_string(size_average, reduce)`` — called only when a legacy argument is
given — and ``get_enum(reduction)``, which maps ``'elementwise_mean'`` (its replacement is shared with ST009:
`safetorch._losses`). Wrapping those two choke points covers
every loss that uses them, present or future (`loss_classes` / `loss_functions` discover them by introspection for
the tests and the docs), and costs a correct call nothing but one string comparison in ``get_enum``: no wrapper
frame sits between the user and a functional loss, so torch's own warnings keep pointing at the user's line.
``_Loss.__init__`` is wrapped as well, because a module stores ``reduction='elementwise_mean'`` as given.

Conversion is torch's own (``legacy_get_string(..., emit_warning=False)``): ``reduce=False`` wins over
``size_average``, and a legacy argument wins over an explicit ``reduction=``. The finding is attributed to the
first frame outside torch — the construction line of a module, the line calling a function, or the
``super().__init__(...)`` line of a user subclass — and torch's deprecation warning, which points inside torch, is
not emitted. In strict mode the helper raises instead, so nothing is converted or built.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import _reduction
from torch.nn.modules import loss as _loss

from .. import _losses
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, is_internal, report
from .._rule import Rule

CODE = "ST002"


class LegacyReductionWarning(SafetorchWarning):
    """ST002: legacy ``size_average``/``reduce`` or ``reduction='elementwise_mean'`` on a loss."""

    code = "ST002"


RULE = Rule("ST002", "legacy-reduction", LegacyReductionWarning,
            "legacy size_average/reduce or reduction='elementwise_mean' on a loss")
_LEGACY = ("size_average", "reduce")
_WHAT = {"mean": "the mean over elements", "sum": "the sum over elements", "none": "one value per element"}


def loss_classes() -> list[type[torch.nn.Module]]:
    """Every loss class whose (possibly inherited) ``__init__`` takes ``size_average``, ``_Loss`` included."""
    seen: list[type[torch.nn.Module]] = []
    stack: list[type[Any]] = [_loss._Loss]
    while stack:
        cls = stack.pop()
        if cls not in seen and "size_average" in inspect.signature(cls.__init__).parameters:
            seen.append(cls)
        stack.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: c.__name__)


def loss_functions() -> dict[str, Callable[..., Any]]:
    """Every function of torch.nn.functional with a ``size_average`` parameter, by name."""
    return {
        name: fn for name, fn in sorted(vars(F).items())
        if inspect.isfunction(fn) and not name.startswith("_") and "size_average" in inspect.signature(fn).parameters
    }


def _module_label(module: object) -> str:
    made = type(module)
    return f"{'nn.' if made.__module__.startswith('torch.') else ''}{made.__name__}(...)"


def _origin(frame: FrameType | None, api: str) -> tuple[FrameType | None, str]:
    """(the user's frame, a label for the torch API it called), walking out of torch from ``frame``."""
    while frame is not None and is_internal(frame.f_code):
        code = frame.f_code
        if code.co_filename.endswith(("functional.py", "loss.py")) and code.co_name != "forward":
            if code.co_name == "__init__":
                api = _module_label(frame.f_locals.get("self"))
            else:
                api = f"F.{code.co_name}(...)"
        frame = frame.f_back
    return frame, api


def _found(message: Callable[[str], str], api: str = "the loss") -> None:
    """Report at the user's line (from inside a torch helper). Raises only in strict mode."""
    __tracebackhide__ = True  # noqa: F841
    if is_compiling():
        return
    frame, api = _origin(sys._getframe(1), api)
    if frame is not None:
        report(CODE, frame, message(api))


def _legacy_message(size_average: Any, reduce: Any, new: str, explicit: Any, api: str) -> str:
    given = ", ".join(f"{k}={v!r}" for k, v in zip(_LEGACY, (size_average, reduce), strict=True) if v is not None)
    text = f"{CODE} {given} is legacy: write reduction={new!r} in {api} ({_WHAT[new]}"
    if reduce is False and size_average is not None:
        text += "; reduce=False overrides size_average"
    if isinstance(explicit, str) and explicit not in (new, "mean"):
        text += f"; it overrides the reduction={explicit!r} also given, as torch does"
    return text + ")"


def _legacy_get_string(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    __tracebackhide__ = True  # noqa: F841
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        bound.apply_defaults()
        if not bound.arguments["emit_warning"]:
            return wrapped(*args, **kwargs)  # asked not to warn: a programmatic use, not a legacy loss argument
        size_average, reduce = bound.arguments["size_average"], bound.arguments["reduce"]
        new = wrapped(size_average, reduce, emit_warning=False)
        caller = sys._getframe(1)
        explicit = caller.f_locals.get("reduction")
        _found(lambda api: _legacy_message(size_average, reduce, new, explicit, api))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)
        return wrapped(*args, **kwargs)
    return new


def _elementwise_mean_message(api: str) -> str:
    return f"{CODE} reduction='elementwise_mean' is legacy: write reduction='mean' in {api}"


def _elementwise_mean() -> None:
    """``get_enum('elementwise_mean')`` (through `safetorch._losses`, which then asks torch for 'mean')."""
    __tracebackhide__ = True  # noqa: F841
    try:
        _found(_elementwise_mean_message)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _loss_init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_Loss.__init__(size_average, reduce, reduction)``: a module would store 'elementwise_mean' as given."""
    __tracebackhide__ = True  # noqa: F841
    if kwargs.get("reduction") == "elementwise_mean" or (len(args) > 2 and args[2] == "elementwise_mean"):
        try:
            size_average = args[0] if args else kwargs.get("size_average")
            reduce = args[1] if len(args) > 1 else kwargs.get("reduce")
            if size_average is None and reduce is None:  # otherwise legacy_get_string decides and reports
                _found(_elementwise_mean_message, _module_label(instance))
                args, kwargs = args[:2], {**kwargs, "reduction": "mean"}
        except Exception as exc:  # strict-mode findings pass through internal_error
            internal_error(CODE, exc)
    return wrapped(*args, **kwargs)


def install(registry: Registry) -> None:
    registry.wrap(_reduction, "legacy_get_string", _legacy_get_string, CODE)
    _losses.listen(CODE, legacy=_elementwise_mean)
    registry.wrap(_loss._Loss, "__init__", _loss_init, CODE)


def uninstall() -> None:
    _losses.unlisten(CODE)
