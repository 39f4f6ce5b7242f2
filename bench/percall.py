"""Per-call cost of every API safetorch wraps: bare, through safetorch, a bare wrapt pass-through, a closure.

The references sit exactly where safetorch's wrapper sits (the same attribute of the same owner), so the four
numbers differ only in what runs between the caller and torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import wrapt

import safetorch
from safetorch._patch import registry

from ._timing import interleaved, paired_ratio, summary


def _passthrough(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return wrapped(*args, **kwargs)


def _target(owner: Any, name: str) -> tuple[Any, bool, Any]:
    """(original object, whether the owner's own dict held it, the object to wrap)."""
    had = name in owner.__dict__
    for klass in getattr(owner, "__mro__", (owner,)):
        if name in klass.__dict__:
            return klass.__dict__[name], had, klass.__dict__[name]
    raise AttributeError(name)


def _closure_for(original: Any, is_method: bool) -> Any:
    if is_method:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self, *args, **kwargs)
        return method

    def function(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)
    return function


def measure(owner: Any, name: str, stmt: Callable[[], Any], *, is_method: bool, number: int,
            repeats: int) -> dict[str, Any]:
    safetorch.uninstall()
    original, had, target = _target(owner, name)

    def put(value: Any) -> Callable[[], None]:
        return lambda: setattr(owner, name, value)

    def back() -> None:
        if had:
            setattr(owner, name, original)
        elif name in owner.__dict__:
            delattr(owner, name)

    variants = {
        "bare": (lambda: None, lambda: None),
        "safetorch": (safetorch.install, safetorch.uninstall),
        "wrapt": (put(wrapt.FunctionWrapper(target, _passthrough)), back),
        "closure": (put(_closure_for(target, is_method)), back),
    }
    samples = interleaved(variants, stmt, number=number, repeats=repeats)
    safetorch.install()
    out = {k: summary(v) for k, v in samples.items()}
    med = {k: v["median"] for k, v in out.items()}
    # Ratios are taken round by round (the two sides measured next to each other), then the median of those.
    out["ratio_vs_wrapt"] = paired_ratio(samples["safetorch"], samples["wrapt"])
    out["ratio_vs_bare"] = paired_ratio(samples["safetorch"], samples["bare"])
    out["closure_ratio_vs_bare"] = paired_ratio(samples["closure"], samples["bare"])
    out["overhead_ns"] = round(med["safetorch"] - med["bare"], 1)
    out["wrapt_overhead_ns"] = round(med["wrapt"] - med["bare"], 1)
    out["closure_overhead_ns"] = round(med["closure"] - med["bare"], 1)
    return out


def cases() -> list[tuple[str, Any, str, Callable[[], Any], bool]]:
    """(label, owner, attribute, statement, is_method) for every wrapped API, with small CPU inputs."""
    x = torch.ones(4)
    xd = torch.ones(4, dtype=torch.float64)
    sink: list[Any] = [None]
    out: list[tuple[str, Any, str, Callable[[], Any], bool]] = []

    def add(label: str, owner: Any, name: str, fn: Callable[[], Any], is_method: bool = True) -> None:
        out.append((label, owner, name, fn, is_method))

    def float_() -> None:
        sink[0] = x.float()  # already float32: torch returns self, the cheapest call, the worst ratio

    def double_() -> None:
        sink[0] = x.double()

    def to_() -> None:
        sink[0] = xd.to(torch.float32)

    def detach_() -> None:
        sink[0] = x.detach()

    add("Tensor.float (no-op)", torch.Tensor, "float", float_)
    add("Tensor.double", torch.Tensor, "double", double_)
    add("Tensor.to(dtype)", torch.Tensor, "to", to_)
    add("Tensor.detach", torch.Tensor, "detach", detach_)
    return [c for c in out if c[2] in {n for _, n in registry.touched()} | {c[2]}]


def run(quick: bool) -> dict[str, Any]:
    number, repeats = (2_000, 5) if quick else (20_000, 15)
    results = {}
    for label, owner, name, stmt, is_method in cases():
        results[label] = measure(owner, name, stmt, is_method=is_method, number=number, repeats=repeats)
    return results
