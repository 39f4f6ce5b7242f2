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


def measure(owner: Any, names: str | tuple[str, ...], stmt: Callable[[], Any], *, is_method: bool, number: int,
            repeats: int) -> dict[str, Any]:
    """``names``: every attribute of ``owner`` that safetorch patches for this API (a context manager's
    ``__enter__`` and ``__exit__``), so that the references wrap exactly as many."""
    safetorch.uninstall()
    names = (names,) if isinstance(names, str) else names
    saved = [(name, name in owner.__dict__, _target(owner, name)[2]) for name in names]

    def put(make: Callable[[Any], Any]) -> Callable[[], None]:
        def enter() -> None:
            for name, _, target in saved:
                setattr(owner, name, make(target))
        return enter

    def back() -> None:
        for name, had, target in saved:
            if had:
                setattr(owner, name, target)
            elif name in owner.__dict__:
                delattr(owner, name)

    variants = {
        "bare": (lambda: None, lambda: None),
        "safetorch": (safetorch.install, safetorch.uninstall),
        "wrapt": (put(lambda t: wrapt.FunctionWrapper(t, _passthrough)), back),
        "closure": (put(lambda t: _closure_for(t, is_method)), back),
    }
    samples = interleaved(variants, stmt, number=number, repeats=repeats)
    safetorch.install()
    out: dict[str, Any] = {k: summary(v) for k, v in samples.items()}
    out["patched_attributes"] = list(names)
    # Ratios are taken round by round (the two sides measured next to each other), then the median of those.
    out["ratio_vs_wrapt"] = paired_ratio(samples["safetorch"], samples["wrapt"])
    out["ratio_vs_bare"] = paired_ratio(samples["safetorch"], samples["bare"])
    out["closure_ratio_vs_bare"] = paired_ratio(samples["closure"], samples["bare"])
    return out


def _no_hook(grad: torch.Tensor) -> None:
    return None


def cases() -> list[tuple[str, Any, str | tuple[str, ...], Callable[[], Any], bool]]:
    """(label, owner, attribute, statement, is_method) for every API safetorch wraps, with small CPU inputs."""
    import torch.nn.functional as F
    from torch.nn import _reduction
    from torch.nn.modules import loss as _loss

    x = torch.ones(4)
    xd = torch.ones(4, dtype=torch.float64)
    module = torch.nn.Linear(4, 4)
    w = torch.ones(4, requires_grad=True)
    graph = (w * 2).sum()
    w2 = torch.ones(4, requires_grad=True)
    variable_meta = type(torch.autograd.Variable)
    sink: list[Any] = [None]
    out: list[tuple[str, Any, str | tuple[str, ...], Callable[[], Any], bool]] = []

    def add(label: str, owner: Any, name: str | tuple[str, ...], fn: Callable[[], Any], is_method: bool = True) -> None:
        out.append((label, owner, name, fn, is_method))

    def float_() -> None:
        sink[0] = x.float()  # already float32: torch returns self, the cheapest call, the worst ratio

    def double_() -> None:
        sink[0] = x.double()

    def to_() -> None:
        sink[0] = xd.to(torch.float32)

    def detach_() -> None:
        sink[0] = x.detach()

    def radd() -> None:
        sink[0] = 1.0 + x

    def mse() -> None:
        sink[0] = F.mse_loss(x, x)

    def loss_module() -> None:
        sink[0] = torch.nn.MSELoss()

    def train() -> None:
        module.train()

    def enable_grad() -> None:
        with torch.enable_grad():
            pass

    def set_grad_enabled() -> None:
        with torch.set_grad_enabled(True):
            pass

    def inference_mode() -> None:
        with torch.inference_mode():
            pass

    def autograd_grad() -> None:
        sink[0] = torch.autograd.grad(graph, w, retain_graph=True)

    def register_hook() -> None:
        w2.register_hook(_no_hook).remove()

    def variable() -> None:
        sink[0] = torch.autograd.Variable(x)

    def backward() -> None:
        graph.backward(retain_graph=True)

    def empty_cache() -> None:
        torch.cuda.empty_cache()

    add("ST001 Tensor.float (a no-op)", torch.Tensor, "float", float_)
    add("ST001 Tensor.double", torch.Tensor, "double", double_)
    add("ST001 Tensor.to(dtype)", torch.Tensor, "to", to_)
    add("ST001 Tensor.detach", torch.Tensor, "detach", detach_)
    add("ST002 F.mse_loss (via _reduction.get_enum)", _reduction, "get_enum", mse, False)
    add("ST002 nn.MSELoss() (_Loss.__init__)", _loss._Loss, "__init__", loss_module)
    add("ST003 Module.train()", torch.nn.Module, "train", train)
    add("ST003 with torch.enable_grad(): (__enter__, __exit__)", torch.autograd.grad_mode.enable_grad,
        ("__enter__", "__exit__"), enable_grad)
    add("ST003 with torch.set_grad_enabled(True): (__enter__, __exit__)",
        torch.autograd.grad_mode.set_grad_enabled, ("__enter__", "__exit__"), set_grad_enabled)
    add("ST003 with torch.inference_mode(): (__enter__, __exit__)", torch.autograd.grad_mode.inference_mode,
        ("__enter__", "__exit__"), inference_mode)
    add("ST003 torch.autograd.grad", torch.autograd, "grad", autograd_grad, False)
    add("ST003 tensor.register_hook(fn).remove()", torch.Tensor, "register_hook", register_hook)
    add("ST004 1.0 + tensor (Tensor.__radd__)", torch.Tensor, "__radd__", radd)
    add("ST005 Variable(x) (VariableMeta.__call__)", variable_meta, "__call__", variable)
    add("ST003/ST006 loss.backward() (torch.autograd.backward)", torch.autograd, "backward", backward, False)
    add("ST007 torch.cuda.empty_cache()", torch.cuda, "empty_cache", empty_cache, False)
    return out


def run(quick: bool) -> dict[str, Any]:
    number, repeats = (1_000, 5) if quick else (10_000, 15)
    results = {}
    for label, owner, name, stmt, is_method in cases():
        slow = "backward" in label or "MSELoss()" in label
        results[label] = measure(owner, name, stmt, is_method=is_method, number=number // (10 if slow else 1),
                                 repeats=repeats)
    return results
