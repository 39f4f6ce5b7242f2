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
import threading
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
    if not _TYPE_DICTOFFSET(type(value)):
        return []
    return gc.get_referents(value)


#: What a class is made of, read through ``type``'s own descriptors: a metaclass's properties never run.
_TYPE_DICTOFFSET = type.__dict__["__dictoffset__"].__get__
_TYPE_MRO = type.__dict__["__mro__"].__get__
_TYPE_DICT = type.__dict__["__dict__"].__get__


def attributes(value: object, keep: Callable[[Any], bool], limit: int) -> list[tuple[str, Any]]:
    """(name, value) for the attributes among an object's first ``limit`` for which ``keep`` is true, as
    ``vars(value)`` would give them. Most objects seen (an optimizer, a data loader) hold none, and are read with
    `own_values` only. A holder's attributes are named from the names its class's code stores (``self.model =
    model``), read with ``object.__getattribute__`` where no class attribute could run code; ``__dict__`` is read
    (and so built) only for what cannot be named that way: a value held twice or under a name no code of the class
    stores, a slot's, one inside a ``__dict__`` that exists or a dict the object holds, a ``threading.local``'s.
    Named values come in the order of the class's first instance, which is ``vars``' unless this instance set its
    attributes in another order."""
    if isinstance(value, threading.local):  # its attributes live apart, per thread, where gc does not show them
        return _from_dict(value, keep, limit)
    held = own_values(value)[:limit + 2]  # and the type, and perhaps the __dict__ itself
    kept = [v for v in held if keep(v)]
    inside = any(type(v) is dict and any(keep(x) for x in list(v.values())[:limit]) for v in held)
    if not kept and not inside:
        return []
    if kept and not inside and len({id(v) for v in kept}) == len(kept):
        named = _named_inline(value, {id(v): v for v in kept})
        if named is not None:  # in the order of the attributes, as vars(value) gives them
            place = {id(v): i for i, v in enumerate(held)}
            return sorted(named, key=lambda pair: place[id(pair[1])])
    return _from_dict(value, keep, limit)


def _from_dict(value: object, keep: Callable[[Any], bool], limit: int) -> list[tuple[str, Any]]:
    namespace = getattr(value, "__dict__", None)
    if not isinstance(namespace, dict):
        return []
    return [(attr, sub) for attr, sub in list(namespace.items())[:limit] if keep(sub)]


def _is_module(value: Any) -> bool:
    """By the object's type alone: ``isinstance`` would read a ``__class__`` property of the program's."""
    return issubclass(type(value), torch.nn.Module)


def _held_modules(value: object) -> list[tuple[str, torch.nn.Module]]:
    """(attribute, module) for the modules among an object's first `_ATTRIBUTES` attributes (`attributes`)."""
    return attributes(value, _is_module, _ATTRIBUTES)


def _named_inline(value: object, kept: dict[int, Any]) -> list[tuple[str, Any]] | None:
    """Each of the ``kept`` values (each held once) under the one name that the class's code stores and the instance
    holds it by; None when one of them is under no such name, or the instance holds it under two."""
    klass = type(value)
    classes = [_TYPE_DICT(k) for k in _TYPE_MRO(klass)]
    named: list[tuple[str, Any]] = []
    for name in _stored_names(klass):
        if any(name in d and not _plain(d[name]) for d in classes):
            continue  # a descriptor could run code, or answer for the instance
        try:
            sub = object.__getattribute__(value, name)  # the instance's value, or a class's plain default
        except Exception:  # AttributeError: not set on this instance
            continue
        if kept.get(id(sub)) is sub:
            named.append((name, sub))
    if len(named) != len(kept) or {id(sub) for _, sub in named} != set(kept):
        return None
    return named


def _plain(default: Any) -> bool:
    """A class attribute that is a value (``model = None``), not a descriptor: the instance's own value, where it has
    one, is what reading the name gives, and no code runs to give it."""
    return not any(n in _TYPE_DICT(k) for k in _TYPE_MRO(type(default)) for n in ("__get__", "__set__", "__delete__"))


#: The names each class's code stores, by the class's id (its own ``__hash__`` never runs), with a reference that
#: tells a new class at a reused id.
_STORED: dict[int, tuple[weakref.ref[type], tuple[str, ...]]] = {}


def _stored_names(klass: type) -> tuple[str, ...]:
    """The attribute names that the functions of ``klass`` and its bases (Python code only) name, nested code
    included: a superset of those its instances set, in a stable order."""
    entry = _STORED.get(id(klass))
    if entry is not None and entry[0]() is klass:
        return entry[1]
    seen: dict[str, None] = {}
    stack = [f.__code__ for k in _TYPE_MRO(klass) for f in _functions(list(_TYPE_DICT(k).values()))][::-1]
    while stack:  # each class's functions in the order they are defined, a function's nested code after it
        code = stack.pop()
        seen.update(dict.fromkeys(code.co_names))
        stack.extend(c for c in reversed(code.co_consts) if isinstance(c, CodeType))
    names = tuple(seen)
    key = id(klass)
    _STORED[key] = (weakref.ref(klass, lambda _, key=key: _STORED.pop(key, None)), names)
    return names


def _functions(attributes: list[Any]) -> list[FunctionType]:
    """The Python functions among a class's attributes: methods, static and class methods, a property's accessors,
    and what a decorated function wraps (``functools.wraps``: ``@torch.no_grad()`` on ``__init__``). Only exact
    types are read: nothing of the program's runs (an object's ``__getattr__``, a subclass's property would)."""
    found: list[FunctionType] = []
    for value in attributes:
        if type(value) in (staticmethod, classmethod):
            value = value.__func__
        parts = (value.fget, value.fset, value.fdel) if type(value) is property else (value,)
        for f in parts:
            while type(f) is FunctionType and f not in found:
                found.append(f)
                f = f.__dict__.get("__wrapped__")
    return found
