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

The finding comes later than the assignment, at the optimizer's line, so it names the assignment's line too, noted
when False is assigned while the check is installed: through ``nn.Module.__setattr__`` (one set lookup per module
attribute assignment, few in a training step) for a module, and through a class attribute of ``torch.Tensor`` for
each misspelling (`_Recorded`; no other tensor attribute's lookup or assignment changes) for a parameter.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from .. import _visible
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, is_internal, report, user_frame
from .._rule import Rule
from .._tracebacks import hide_own_frames

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


#: The attribute names whose assignment is recorded: the module attribute and the misspellings people write.
_RECORDED = ("requires_grad", "require_grad", "requires_grads", "require_grads", "requiresgrad", "requiregrad")
_MODULE_NAMES = frozenset(_RECORDED)
#: On a tensor ``requires_grad`` is torch's own property: only the misspellings are recorded.
_TENSOR_NAMES = _RECORDED[1:]
_MISSING = object()
#: Where a False freeze flag was assigned: (id(object), name) -> (weak reference to the object, filename, line).
_setters: dict[tuple[int, str], tuple[weakref.ref[Any], str, int]] = {}


def _module_setattr(original: Any) -> Any:
    """``nn.Module.__setattr__`` as a plain function (see `safetorch._patch`): torch's, then, for the few names in
    `_MODULE_NAMES` only, a note of the line. One set lookup on every other assignment, of which a training step
    makes none or few. Not a class attribute `_Recorded` as on tensors: a module's ``dir()`` lists its class's
    attributes and torch itself reads each of them (dynamo's ``getattr(root, attr) for attr in dir(root)``), where
    an attribute that a module does not hold must raise."""

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        __tracebackhide__ = True  # noqa: F841
        try:
            original(self, name, value)
            if name in _MODULE_NAMES:
                _noted(self, name, value, sys._getframe(1))
        except BaseException as exc:  # no frame of ours in the traceback of what passes through
            hide_own_frames(exc)
            raise

    return __setattr__


class _Recorded:
    """``torch.Tensor.<misspelling>`` while ST015 is installed: a data descriptor through which ``p.require_grad =
    False`` notes its line. Tensors have no Python ``__setattr__`` to wrap (and ``p.grad = None`` runs at every
    step), so the class attribute is what only these assignments pay for. Reads and assignments behave as for a
    plain instance attribute: the value lives in the instance's ``__dict__`` (where `_freeze_flag` looks), and a
    missing one raises AttributeError as before. A class later in a subclass's MRO that defines the name keeps its
    meaning: a data descriptor there is used as is, a plain value or method there is found when the instance holds
    none. Not a `property`: ``torch.jit.script`` compiles the properties it finds on a class."""

    __slots__ = ("_name", "_owner")

    def __init__(self, owner: type, name: str) -> None:
        self._owner, self._name = owner, name

    def __repr__(self) -> str:
        return f"<safetorch ST015 attribute {self._owner.__qualname__}.{self._name}>"

    def _later(self, kind: type) -> Any:
        """What a class after the owner in ``kind``'s MRO defines under the name, or `_MISSING`."""
        mro = kind.__mro__
        for klass in mro[mro.index(self._owner) + 1:] if self._owner in mro else ():
            if self._name in vars(klass):
                return vars(klass)[self._name]
        return _MISSING

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        later = self._later(type(obj))
        if later is not _MISSING and hasattr(type(later), "__set__"):
            return type(later).__get__(later, obj, type(obj))
        namespace = getattr(obj, "__dict__", None)
        if namespace is not None and self._name in namespace:
            return namespace[self._name]
        if later is not _MISSING:
            return type(later).__get__(later, obj, type(obj)) if hasattr(type(later), "__get__") else later
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {self._name!r}")

    def __set__(self, obj: Any, value: Any) -> None:
        later = self._later(type(obj))
        if later is not _MISSING and hasattr(type(later), "__set__"):
            type(later).__set__(later, obj, value)
            return
        obj.__dict__[self._name] = value
        _noted(obj, self._name, value, sys._getframe(1))

    def __delete__(self, obj: Any) -> None:
        later = self._later(type(obj))
        if later is not _MISSING and hasattr(type(later), "__delete__"):
            type(later).__delete__(later, obj)
            return
        try:
            del obj.__dict__[self._name]
        except KeyError:
            raise AttributeError(self._name) from None
        _setters.pop((id(obj), self._name), None)


def _noted(obj: Any, name: str, value: Any, frame: FrameType | None) -> None:
    """`_record`, guarded: the assignment is done, and failing to note where it was made must not undo it."""
    try:
        _record(obj, name, value, frame)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _record(obj: Any, name: str, value: Any, frame: FrameType | None) -> None:
    """Note where ``obj.<name> = False`` was written: the line that assigned it (past a subclass's own
    ``__setattr__`` that called torch's). A value set by torch or safetorch (unpickling a parameter sets its
    attributes) is no line of the program's, and a later assignment of anything else forgets the note."""
    key = (id(obj), name)
    _setters.pop(key, None)
    if value is not False:
        return
    while frame is not None and frame.f_code.co_name == "__setattr__":
        frame = frame.f_back
    if frame is None or is_internal(frame.f_code):
        return

    def forget(ref: weakref.ref[Any]) -> None:
        entry = _setters.get(key)
        if entry is not None and entry[0] is ref:
            del _setters[key]

    try:
        ref = weakref.ref(obj, forget)
    except TypeError:  # an object that takes no weak reference: its place is not kept
        return
    _setters[key] = (ref, frame.f_code.co_filename, frame.f_lineno)


def _setter(obj: Any, name: str) -> tuple[str, int] | None:
    """The recorded place of ``obj.<name> = False``, if this object's flag was set while the check was installed."""
    entry = _setters.get((id(obj), name))
    if entry is None or entry[0]() is not obj:
        return None
    return entry[1], entry[2]


def _at(places: list[tuple[str, int] | None]) -> str:
    """`` in its place, at train.py:12`` for the recorded assignments (three at most, then how many more), or ''
    when none is recorded: the line a user clicks to fix it."""
    known = list(dict.fromkeys(p for p in places if p is not None))
    if not known:
        return ""
    shown = ", ".join(f"{filename}:{lineno}" for filename, lineno in known[:3])
    more = f" and {len(known) - 3} more" if len(known) > 3 else ""
    return f" in its place, at {shown}{more}"


def _modules(frame: FrameType) -> list[tuple[str, nn.Module]]:
    """The modules the caller's variables hold, with the variable's name (the first one, locals first)."""
    seen: dict[int, tuple[str, nn.Module]] = {}
    for scope in (_visible.frame_locals(frame), frame.f_globals):
        for name, value in list(scope.items()):
            if isinstance(value, nn.Module):
                seen.setdefault(id(value), (name, value))
    return list(seen.values())


def _findings(optimizer: Optimizer, frame: FrameType) -> list[str]:
    held = [p for group in optimizer.param_groups for p in group["params"]]
    found: list[str] = []
    typo: dict[str, list[tuple[str, int] | None]] = {}
    for p in held:
        attrs = getattr(p, "__dict__", None)
        if attrs and p.requires_grad:
            name = _freeze_flag(attrs)
            if name is not None:
                typo.setdefault(name, []).append(_setter(p, name))
    for name, places in typo.items():
        found.append(f"`p.{name} = False` on {len(places)} parameter(s) the optimizer holds set an attribute torch "
                     f"never reads: they still require grad and will be trained. Write p.requires_grad = False (or "
                     f"module.requires_grad_(False)){_at(places)}")
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
                             f"grad and will be trained. Write {label}.requires_grad_(False)"
                             f"{_at([_setter(module, name)])}")
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
    registry.replace(nn.Module, "__setattr__", _module_setattr, CODE)
    for name in _TENSOR_NAMES:
        present = next((vars(k)[name] for k in torch.Tensor.__mro__ if name in vars(k)), _MISSING)
        if present is _MISSING or isinstance(present, _Recorded):  # never in place of torch's own attribute
            registry.set(torch.Tensor, name, _Recorded(torch.Tensor, name), CODE)
