"""The modules a frame can see by name: what a finding about "a model" names (ST020's loss network) and where a rule
looks for the models an optimizer trains (ST019).

Design rules:
- No ``gc`` walk and nothing recursive: a frame's locals, then its globals, and one attribute level below an object
  they hold (``self.vgg``, ``trainer.model``), bounded by `LIMIT` names; asked at a looked-at step or for a finding,
  never per call.
- An object is read without building its ``__dict__`` (`own_values`). CPython 3.11 and 3.12 keep a plain object's
  attributes inline until something asks for ``__dict__``; once it is built, every attribute read of that object
  takes the slower path for the rest of the run. Built for an SGD optimizer seen at a looked-at step, it cost the
  tiny MLP's loop 5.4k instructions a step pair (+0.5%), in torch's own ``step`` and ``zero_grad``.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from types import BuiltinFunctionType, CodeType, FrameType, FunctionType, MethodType, ModuleType
from typing import Any

import torch

from ._callsite import frame_locals

__all__ = ["LIMIT", "attributes", "frame_locals", "modules", "own_values"]

LIMIT = 256  # names looked at, and modules returned, at most
_ATTRIBUTES = 64  # attributes looked at per object
_NOT_HOLDERS = (type, ModuleType, FunctionType, BuiltinFunctionType, MethodType, torch.Tensor)
def modules(frame: FrameType, limit: int = LIMIT) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) for the modules the frame sees: its locals, then its globals, then those one attribute below a
    local or global object that is not a module itself, in that order (a name may be given twice)."""
    found: list[tuple[str, torch.nn.Module]] = []
    local = frame_locals(frame)
    scopes = [local] if local is frame.f_globals else [local, frame.f_globals]
    looked = 0
    for scope in scopes:
        for name, value in list(scope.items()):
            looked += 1
            if looked > limit or len(found) >= limit:
                return found
            if isinstance(value, torch.nn.Module):
                found.append((name, value))
            elif not isinstance(value, _NOT_HOLDERS):
                found.extend((f"{name}.{attr}", sub) for attr, sub in _held_modules(value))
    return found


def own_values(value: object) -> list[Any]:
    """What an object with a ``__dict__`` holds in its attributes, read as the garbage collector reads it: the values
    themselves while CPython keeps them inline, else the ``__dict__`` that was built (and the object's type, and any
    ``__slots__`` values). Empty for an object without a ``__dict__``. Never builds the ``__dict__`` (see the module's
    design rules)."""
    if not type(value).__dictoffset__:
        return []
    return gc.get_referents(value)


def attributes(value: object, keep: Callable[[Any], bool], limit: int) -> list[tuple[str, Any]]:
    """(name, value) for the attributes among an object's first ``limit`` for which ``keep`` is true, as
    ``vars(value)`` would give them, in its order. Most objects seen (an optimizer, a data loader) hold none, and are
    read with `own_values` only. A holder's attributes are named from the names its class's code stores
    (``self.model = model``), read with ``object.__getattribute__`` where no class attribute could intercept; only
    what cannot be named that way, or what lies in a ``__dict__`` (one that exists, or a dict the object holds), is
    named from ``__dict__``."""
    held = own_values(value)[:limit + 2]  # and the type, and perhaps the __dict__ itself
    kept = {id(v): v for v in held if keep(v)}
    inside = any(type(v) is dict and any(keep(x) for x in list(v.values())[:limit]) for v in held)
    if not kept and not inside:
        return []
    if kept and not inside:
        named = _named_inline(value, kept)
        if named is not None:  # in the order of the attributes, as vars(value) gives them
            places: dict[int, list[int]] = {}
            for i, v in enumerate(held):
                places.setdefault(id(v), []).append(i)
            taken: dict[int, int] = {}  # a value held twice: its names in the order the code names them
            keys = []
            for _, sub in named:
                n = taken[id(sub)] = taken.get(id(sub), -1) + 1
                where = places[id(sub)]
                keys.append(where[min(n, len(where) - 1)])
            return [pair for _, pair in sorted(zip(keys, named, strict=True), key=lambda t: t[0])]
    namespace = getattr(value, "__dict__", None)
    if not isinstance(namespace, dict):
        return []
    return [(attr, sub) for attr, sub in list(namespace.items())[:limit] if keep(sub)]


def _is_module(value: Any) -> bool:
    return isinstance(value, torch.nn.Module)


def _held_modules(value: object) -> list[tuple[str, torch.nn.Module]]:
    """(attribute, module) for the modules among an object's first `_ATTRIBUTES` attributes (`attributes`)."""
    return attributes(value, _is_module, _ATTRIBUTES)


def _named_inline(value: object, kept: dict[int, Any]) -> list[tuple[str, Any]] | None:
    """Each of the ``kept`` values under every name that the class's code stores and the instance holds it by; None
    when one of them is under no such name."""
    klass = type(value)
    defined = {name for k in klass.__mro__ for name in vars(k)}
    named: list[tuple[str, Any]] = []
    for name in _stored_names(klass):
        if name in defined:
            continue  # a property or a method could run code, or answer for the instance
        try:
            sub = object.__getattribute__(value, name)
        except Exception:  # AttributeError: not set on this instance
            continue
        if kept.get(id(sub)) is sub:
            named.append((name, sub))
    if {id(sub) for _, sub in named} != set(kept):
        return None
    return named


_STORED: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _stored_names(klass: type) -> tuple[str, ...]:
    """The attribute names that the functions of ``klass`` and its bases (Python code only) name, nested code
    included: a superset of those its instances set, in a stable order."""
    names = _STORED.get(klass)
    if names is None:
        seen: dict[str, None] = {}
        stack = [f.__code__ for k in klass.__mro__ for f in _functions(list(vars(k).values()))][::-1]
        while stack:  # each class's functions in the order they are defined, a function's nested code after it
            code = stack.pop()
            seen.update(dict.fromkeys(code.co_names))
            stack.extend(c for c in reversed(code.co_consts) if isinstance(c, CodeType))
        names = _STORED[klass] = tuple(seen)
    return names


def _functions(attributes: list[Any]) -> list[FunctionType]:
    """The Python functions among a class's attributes: methods, static and class methods, a property's accessors.
    Only types are tested: nothing of the program's runs (an object's ``__getattr__`` would)."""
    found: list[FunctionType] = []
    for value in attributes:
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
        found.extend(f for f in parts if isinstance(f, FunctionType))
    return found
