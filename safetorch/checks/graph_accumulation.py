"""ST004: a tensor that carries a graph accumulated into a Python number (``total_loss += loss``).

``total_loss = 0.0; total_loss += loss`` turns ``total_loss`` into a tensor that holds the autograd graph of every
step it has summed: memory grows every step. Python calls ``Tensor.__radd__`` only when the left operand is not a
tensor, so ordinary tensor arithmetic never reaches this wrapper; for a number on the left it asks the call-site
reader whether the instruction is ``acc += x`` or ``acc = acc + x`` (the same name stored back). Look-alikes such as
``y = 1 + w`` or ``scale = 0.5 + w * 2`` are not accumulations and stay silent.
"""

from __future__ import annotations

import ast
import sys
from types import FrameType
from typing import Any

import torch

from .._callsite import accumulates, call_source
from .._exceptions import SafetorchError
from .._patch import Registry
from .._report import internal_error, is_internal, report

CODE = "ST004"

_is_compiling = torch.compiler.is_compiling
_NUMBER = (int, float, complex)


def _message(frame: FrameType, value: torch.Tensor) -> str:
    fix = ".item()" if value.numel() == 1 else ".detach()"
    target = addend = None
    op = "+="
    text = call_source(frame)
    try:
        node: Any = ast.parse(text.strip(), mode="exec").body[0] if text else None
    except SyntaxError:
        node = None
    if isinstance(node, ast.AugAssign):
        target, addend = ast.unparse(node.target), node.value
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.BinOp):  # acc = acc + x: the BinOp's text
        target, addend = ast.unparse(node.value.left), node.value.right
        op = f"= {target} +"
    if target is None or addend is None:
        target, shown = "total", "loss"
    else:
        shown = ast.unparse(addend)
        if not isinstance(addend, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
            shown = f"({shown})"
    return (f"{CODE} {target} {op} {shown} adds a tensor that requires grad to a Python number: {target} becomes "
            f"a tensor that keeps the autograd graph of every step it sums, and memory grows every step. "
            f"Write: {target} {op} {shown}{fix}")


def _radd(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          _getframe: Any = sys._getframe) -> Any:
    __tracebackhide__ = True  # noqa: F841
    result = wrapped(*args, **kwargs)
    try:
        if (instance is not None and instance.requires_grad and args and isinstance(args[0], _NUMBER)
                and not isinstance(args[0], bool)):
            frame = _getframe(1)
            if accumulates(frame) and not _is_compiling() and not is_internal(frame.f_code):
                report(CODE, frame, lambda: _message(frame, instance))
    except SafetorchError:
        raise
    except Exception as exc:
        internal_error(CODE, exc)
    return result


def install(registry: Registry) -> None:
    registry.wrap(torch.Tensor, "__radd__", _radd, CODE)
