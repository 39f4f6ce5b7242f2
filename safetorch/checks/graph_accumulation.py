"""ST004: a tensor that carries a graph accumulated into a Python number (``total_loss += loss``).

``total_loss = 0.0; total_loss += loss`` turns ``total_loss`` into a tensor that holds the autograd graph of every
step it has summed: memory grows every step. Python calls ``Tensor.__radd__`` only when the left operand is not a
tensor, so ordinary tensor arithmetic never reaches this wrapper; for a number on the left it asks the call-site
reader whether the instruction is ``acc += x`` or ``acc = acc + x`` (the same name stored back). Look-alikes such as
``y = 1 + w`` or ``scale = 0.5 + w * 2`` are not accumulations and stay silent.

An accumulation into a number is also how a regularisation term is built (``l2 = 0.0; for p in params: l2 +=
p.norm()``), which is legitimate: it is part of this step's loss. So the finding is made at once only for a tensor
a backward() has already started from (``loss.backward(); total_loss += loss``); otherwise the accumulator is
watched, and reported at its line once it has outlived two backwards — when it sums across steps.
"""

from __future__ import annotations

import ast
import sys
import weakref
from collections import deque
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from .. import _backward
from .._callsite import accumulates, accumulation_names, call_source
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._patch import MethodPatch, Registry
from .._report import internal_error, is_internal, report, report_at
from .._rule import Rule
from .._tracebacks import hide_own_frames

CODE = "ST004"


class GraphAccumulationWarning(SafetorchWarning):
    """ST004: a tensor carrying a graph was accumulated into a Python number."""

    code = "ST004"


RULE = Rule("ST004", "graph-accumulation", GraphAccumulationWarning,
            "a loss carrying a graph accumulated into a Python number")

_is_compiling = is_compiling
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
    if target is not None and addend is not None:
        shown = ast.unparse(addend)
        if not isinstance(addend, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
            shown = f"({shown})"
    elif text is None:  # no columns (3.10): the names the bytecode proves, or none
        target, shown, in_place = accumulation_names(frame)
        op = "+=" if in_place else f"= {target} +"
    else:
        shown = None
    if target is None or shown is None:
        return (f"{CODE} a tensor that requires grad is added to a Python number{f' ({target})' if target else ''}: "
                f"the sum becomes a tensor that keeps the autograd graph of every step it adds, and memory grows "
                f"every step. Write: add the tensor's {fix} instead of the tensor")
    return (f"{CODE} {target} {op} {shown} adds a tensor that requires grad to a Python number: {target} becomes "
            f"a tensor that keeps the autograd graph of every step it sums, and memory grows every step. "
            f"Write: {target} {op} {shown}{fix}")


# The tensors the last backward() calls started from, as weak references (a WeakSet would compare tensors with ==).
# Accumulating one of them into a number is the pitfall for certain: its step is over. Only the last few are kept:
# one weak reference per backward, with no callback, is all a training step pays; an older one is still caught by
# the watch below.
_backwarded: deque[weakref.ref[torch.Tensor]] = deque(maxlen=8)


@dataclass
class _Watch:
    """An accumulator made from a tensor no backward() had used yet: a finding once it outlives two backwards."""

    result: weakref.ref[torch.Tensor]
    filename: str
    lineno: int
    module_globals: dict[str, Any]
    message: str
    backwards: int = 0


_watches: dict[tuple[str, int], _Watch] = {}


def _was_backwarded(t: torch.Tensor) -> bool:
    return any(ref() is t for ref in _backwarded)


class _RAdd(MethodPatch):
    """``Tensor.__radd__``, which Python calls only for ``number + tensor``: torch's, then a look at the call site."""

    @staticmethod
    def calling(wrapped: Any, name: str) -> Any:
        def radd(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            try:
                result = wrapped(*args, **kwargs)
                try:
                    if len(args) == 2:
                        instance, other = args
                        if instance.requires_grad and isinstance(other, _NUMBER) and not isinstance(other, bool):
                            frame = _getframe(1)
                            if accumulates(frame) and not _is_compiling() and not is_internal(frame.f_code):
                                if _was_backwarded(instance):
                                    report(CODE, frame, lambda: _message(frame, instance))
                                else:
                                    _watch(frame, instance, result)
                except Exception as exc:  # strict-mode findings pass through internal_error
                    internal_error(CODE, exc)
                return result
            except BaseException as exc:  # no frame of ours in the traceback of what passes through
                hide_own_frames(exc)
                raise

        return radd


_getframe = sys._getframe


def _watch(frame: FrameType, value: torch.Tensor, result: Any) -> None:
    """``l2 = 0.0; for p in params: l2 += p.norm()`` builds a term of this step's loss: legitimate. The pitfall's
    accumulator instead outlives the steps it sums. Watch the result and decide at the coming backwards."""
    key = (frame.f_code.co_filename, frame.f_lineno)
    known = _watches.get(key)
    if isinstance(result, torch.Tensor) and (known is None or known.result() is None):
        _watches[key] = _Watch(weakref.ref(result), key[0], key[1], frame.f_globals, _message(frame, value))


def _before_backward(tensors: Any) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        if isinstance(tensors, torch.Tensor):
            _backwarded.append(weakref.ref(tensors))
        else:
            _backwarded.extend(weakref.ref(t) for t in tuple(tensors or ()) if isinstance(t, torch.Tensor))
        if _watches:
            for key, watch in list(_watches.items()):
                if watch.result() is None:
                    del _watches[key]
                    continue
                watch.backwards += 1
                if watch.backwards >= 2:  # it has outlived a whole step: it accumulates across steps
                    del _watches[key]
                    report_at(CODE, watch.filename, watch.lineno, watch.module_globals, watch.message)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def install(registry: Registry) -> None:
    registry.method(torch.Tensor, "__radd__", _RAdd, CODE)
    _backward.listen(CODE, before=_before_backward)


def uninstall() -> None:
    _backward.unlisten(CODE)
    _backwarded.clear()
    _watches.clear()
