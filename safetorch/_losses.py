"""The one replacement of ``torch.nn._reduction.get_enum`` that checks share (ST002 converts the legacy
``'elementwise_mean'``, ST009 reads the input of ``cross_entropy``, ``nll_loss`` and
``binary_cross_entropy_with_logits``).

Design rules: every functional loss of torch calls ``get_enum(reduction)`` from its own frame, so this single
choke point sees every loss with its arguments one frame up, and no wrapper frame stands between the user and a
functional loss (torch's own warnings keep pointing at the user's line, tracebacks show no safetorch frame). It is
a plain function put in place by `Registry.replace`, as every loss calls it. A loss that a check reads is found by
its code object: the other losses pay a dict lookup.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from torch.nn import _reduction

from ._compat import is_compiling
from ._patch import registry

GROUP = "core:get_enum"

#: ``legacy()``: called for ``reduction='elementwise_mean'``; reports it (raises in strict mode).
Legacy = Callable[[], None]
#: ``look(loss_frame)``: the frame of the functional loss that is calling ``get_enum``.
Look = Callable[[FrameType], None]

_legacy: dict[str, Legacy] = {}
_looks: dict[CodeType, Look] = {}
_owners: dict[str, list[CodeType]] = {}
_is_compiling = is_compiling


def _dispatch(original: Any) -> Any:
    """A plain function, not a wrapt proxy (see `Registry.replace`): every loss computation calls it."""

    def get_enum(reduction: str) -> int:
        __tracebackhide__ = True  # noqa: F841
        if reduction == "elementwise_mean" and _legacy:
            for legacy in list(_legacy.values()):
                legacy()
            reduction = "mean"
        if _looks and not _is_compiling():
            caller = sys._getframe(1)
            look = _looks.get(caller.f_code)
            if look is not None:
                look(caller)
        return original(reduction)  # type: ignore[no-any-return]

    return get_enum


def _update() -> None:
    if _legacy or _looks:
        registry.replace(_reduction, "get_enum", _dispatch, GROUP)
    else:
        registry.restore(GROUP)


def listen(code: str, legacy: Legacy | None = None, looks: dict[CodeType, Look] | None = None) -> None:
    if legacy is not None:
        _legacy[code] = legacy
    for loss_code, look in (looks or {}).items():
        _looks[loss_code] = look
        _owners.setdefault(code, []).append(loss_code)
    _update()


def unlisten(code: str) -> None:
    _legacy.pop(code, None)
    for loss_code in _owners.pop(code, []):
        _looks.pop(loss_code, None)
    _update()
