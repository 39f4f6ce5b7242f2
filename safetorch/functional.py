"""Functional losses normalised by the spatial size: ``hw_normalized(F.cross_entropy)``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ._hw import check_by, divisor

__all__ = ["hw_normalized"]


def hw_normalized(loss_fn: Callable[..., torch.Tensor], by: str = "hw") -> Callable[..., torch.Tensor]:
    """Return ``loss_fn`` summed over all elements and divided by the input's spatial size (× N for ``by="nhw"``).

    The result has ``loss_fn``'s signature; it calls ``loss_fn(..., reduction="sum")`` and passes every other
    argument through (``weight``, ``ignore_index``, ``label_smoothing``, …)::

        seg_loss = hw_normalized(F.cross_entropy)
        loss = seg_loss(score, target, weight=class_weights)

    A caller passing another ``reduction`` (or legacy ``size_average``/``reduce``) gets a ``ValueError``.
    """
    check_by(by)
    signature = inspect.signature(loss_fn)
    params = list(signature.parameters)
    if "reduction" not in params:
        raise ValueError(f"{getattr(loss_fn, '__name__', loss_fn)!r} takes no reduction= argument")
    # Positional arguments that reach no reduction-related parameter take the fast path, without binding.
    limit = min(params.index(k) for k in ("size_average", "reduce", "reduction") if k in params)

    @functools.wraps(loss_fn)
    def normalized(*args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > limit or any(k in kwargs for k in ("size_average", "reduce")) \
                or kwargs.get("reduction", "sum") != "sum":
            bound = signature.bind(*args, **kwargs)
            given = {k: bound.arguments[k] for k in ("reduction", "size_average", "reduce")
                     if bound.arguments.get(k) not in (None, "sum")}
            if given:
                shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
                raise ValueError(f"hw_normalized({loss_fn.__name__}) sums and normalises itself; {shown} would "
                                 f"reduce a second time. Write: call it without reduction=")
            bound.arguments.pop("reduction", None)
            args, kwargs = bound.args, bound.kwargs
        input = args[0] if args else kwargs[params[0]]
        n = divisor(input, by)
        return loss_fn(*args, **{**kwargs, "reduction": "sum"}) / n

    return normalized
