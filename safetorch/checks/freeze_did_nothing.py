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

The optimizer is where the mistake is proved, the assignment where it is fixed: the finding is reported at the
assignment's line (its ``# safetorch: ignore[ST015]`` comment, its annotation in CI), and its message names the
optimizer's line. That line is noted when False is assigned while the check is installed: through
``nn.Module.__setattr__`` (one set lookup per module attribute assignment, few in a training step) for a module, and
through a class attribute of ``torch.Tensor`` for each misspelling (`_Recorded`; no other tensor attribute's lookup
or assignment changes) for a parameter. An assignment made before the check was installed has no known line: it is
reported at the optimizer's line.
"""

from __future__ import annotations

import linecache
import re
import sys
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from .. import _visible
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, is_internal, report, report_at, user_frame
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


@dataclass(frozen=True)
class _Place:
    """A line that assigned a freeze flag: where the finding is reported, and where its comments are read."""

    filename: str
    lineno: int
    globals: dict[str, Any] = field(compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"


#: Where a False freeze flag was assigned: (id(object), name) -> (weak reference to the object, its place).
_setters: dict[tuple[int, str], tuple[weakref.ref[Any], _Place]] = {}


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

    def forget(ref: weakref.ref[Any], setters: dict[Any, Any] = _setters) -> None:
        # the dict itself, not the module's name for it: at interpreter exit that name may already be None
        entry = setters.get(key)
        if entry is not None and entry[0] is ref:
            del setters[key]

    try:
        ref = weakref.ref(obj, forget)
    except TypeError:  # an object that takes no weak reference: its place is not kept
        return
    _setters[key] = (ref, _Place(frame.f_code.co_filename, frame.f_lineno, frame.f_globals))


def _setter(obj: Any, name: str) -> _Place | None:
    """The recorded place of ``obj.<name> = False``, if this object's flag was set while the check was installed."""
    entry = _setters.get((id(obj), name))
    if entry is None or entry[0]() is not obj:
        return None
    return entry[1]


def _receiver(place: _Place, name: str) -> str | None:
    """What the assignment's line wrote before ``.<name> = False`` (``p``, ``self.backbone``), to name the fix in the
    program's own words; None when the line does not read so (the assignment spans lines, or goes through setattr)."""
    line = linecache.getline(place.filename, place.lineno, place.globals)
    found = re.search(rf"([A-Za-z_][\w.\[\]'\"]*)\s*\.\s*{re.escape(name)}\s*=\s*False\b", line)
    return found.group(1) if found else None


def _modules(frame: FrameType) -> list[tuple[str, nn.Module]]:
    """The modules the caller's variables hold, with the variable's name (the first one, locals first), and those one
    attribute below an object that is not a module (``self.model`` where ``self`` is a trainer that builds the
    optimizer in its ``__init__``, CSCYQJ/MICCAI23-ProtoContra-SFDA#18)."""
    seen: dict[int, tuple[str, nn.Module]] = {}
    for name, value in _visible.modules(frame):
        seen.setdefault(id(value), (name, value))
    return list(seen.values())


_TYPO_FIX = "(or module.requires_grad_(False))"


def _may_hold_false(obj: object) -> bool:
    """Whether one of the object's attributes, or a value in a ``__dict__`` it has, is False."""
    return any(v is False or (type(v) is dict and any(x is False for x in list(v.values())))
               for v in _visible.own_values(obj))


def _findings(optimizer: Optimizer, frame: FrameType) -> list[tuple[_Place | None, str]]:
    """What the optimizer built at ``frame``'s line proves: each mistaken assignment that was seen, with its place and
    the message for it; those made before the check was installed (no place known), for the optimizer's line."""
    built = f"the optimizer built at {frame.f_code.co_filename}:{frame.f_lineno}"
    held = [p for group in optimizer.param_groups for p in group["params"]]
    found: list[tuple[_Place | None, str]] = []
    typo: dict[str, dict[_Place | None, int]] = {}
    for p in held:
        if p.requires_grad and _may_hold_false(p):  # its __dict__ is read only then (`_visible.own_values`)
            name = _freeze_flag(getattr(p, "__dict__", None) or {})
            if name is not None:
                places = typo.setdefault(name, {})
                place = _setter(p, name)
                places[place] = places.get(place, 0) + 1
    for name, places in typo.items():
        for place, n in places.items():
            if place is None:
                found.append((None, f"`p.{name} = False` on {n} parameter(s) the optimizer holds set an attribute "
                                    f"torch never reads: they still require grad and will be trained. Write: "
                                    f"p.requires_grad = False {_TYPO_FIX} where it was set"))
                continue
            receiver = _receiver(place, name) or "p"
            found.append((place, f"`{receiver}.{name} = False` sets an attribute torch never reads: the {n} "
                                 f"parameter(s) it was set on still require grad, and {built} holds them, so they "
                                 f"will be trained. Write: {receiver}.requires_grad = False {_TYPO_FIX}"))
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
            if not trained:
                continue
            reported.add(id(module))
            label = f"{variable}.{path}" if path else variable
            place = _setter(module, name)
            if place is None:
                found.append((None, f"`{label}.{name} = False` ({type(module).__name__}) set an attribute of the "
                                    f"module, which freezes nothing: {trained} of its parameters the optimizer holds "
                                    f"still require grad and will be trained. Write: {label}.requires_grad_(False)"))
                continue
            receiver = _receiver(place, name) or label
            found.append((place, f"`{receiver}.{name} = False` ({type(module).__name__}) sets an attribute of the "
                                 f"module, which freezes nothing: {trained} of its parameters still require grad, and "
                                 f"{built} holds them ({label}), so they will be trained. Write: "
                                 f"{receiver}.requires_grad_(False)"))
    return found


def _optimizer_init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    __tracebackhide__ = True  # noqa: F841
    result = wrapped(*args, **kwargs)
    try:
        if isinstance(instance, Optimizer):
            frame = user_frame(sys._getframe(1))
            if frame is not None:
                found = _findings(instance, frame)
                for place, text in found:  # at the line to fix
                    if place is not None:
                        report_at(CODE, place.filename, place.lineno, place.globals, f"{CODE} {text}")
                unplaced = [text for place, text in found if place is None]
                if unplaced:  # made before the check was installed: at the optimizer's line, in one message
                    report(CODE, frame, f"{CODE} " + "; and ".join(unplaced))
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
