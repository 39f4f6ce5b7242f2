"""The one registry every patch goes through.

Design rules (from wrapt and dd-trace-py):
- A patch records what stood in the owner's own ``__dict__`` (or that nothing did) and `restore` puts exactly that
  back, by identity; an attribute that was only inherited (``Tensor.float`` lives on ``torch._C.TensorBase``, whose
  type is immutable) is added to the owner and deleted again. Nothing is ever restored through ``__wrapped__``:
  torch's own ``functools.wraps`` sets it too.
- Patching twice is a no-op, never a second layer, even across a reloaded copy of this module (the marker is an
  attribute of the wrapper type, or of a plain replacement function, not an ``isinstance`` check against this
  module's class).
- Some patches are plain functions instead of wrapt proxies (`Registry.replace`):
  * the choke points torch itself calls on every training step: ``torch.autograd.backward`` (every backward),
    ``torch.nn._reduction.get_enum`` (every loss) and ``Module.train`` (once per child module). A wrapt wrapper on
    a class attribute builds a bound proxy on every call: on the CI machine an SGD step measured about 8 µs slower
    with one on a grad-mode choke point, and no measurable difference with a plain function doing the same
    bookkeeping;
  * ``Module.__getstate__``, which must see its direct caller (``copy.deepcopy``).
  The plain function carries the original's doc and ``__wrapped__`` and is named after where it stands
  (``Module.train`` in ``torch.nn.modules.module``), so it inspects as the original and pickles by reference; it is
  recorded and restored exactly like a wrapt patch.
- A wrapt-style wrapper on a *class* attribute (``Module.load_state_dict``, ``enable_grad.__enter__``) is put in
  place as a plain function too (`_adapter`), which calls the wrapper as wrapt would: it binds in C like the original
  and stays one object.
- The module-level functions a training step may call (``F.dropout``, which every ``nn.Dropout`` forward calls;
  ``clip_grad_norm_``; ``torch.cuda.empty_cache``) are plain functions too (`Registry.replace`): a wrapt proxy costs
  2.3-3x a plain call. A replacement that TorchScript may compile (``F.dropout``, called by scripted forwards) has
  torch's globals (`with_globals_of`). `Registry.wrap` on a module makes a wrapt proxy: ``torch.autograd.grad`` and
  ``legacy_get_string``, called a few times per step at most.
- The tensor methods that every training step may call (ST001's conversions: ``x.to(device)``, ``x.float()``) are
  `MethodPatch` objects (`Registry.method`): one object per method, so ``torch.Tensor.float is torch.Tensor.float``,
  a `property` whose getter binds the replacement function in C, as a function attribute would. Counted under
  callgrind (``y = x.float()`` in a function called 1000 times), a call costs about 3.0k instructions bare, 7.4k
  with ST001's check through a `MethodPatch` (9.7k when it bound through a Python ``__get__``), and 9.5k through a
  wrapt proxy whose wrapper does nothing (its bound proxy, a Python subclass of wrapt's type, is built on every
  access): a `MethodPatch` with ST001's check costs less than that empty wrapt proxy. A `MethodPatch` compares equal
  to, and hashes as, the method it replaces: torch's own ``__torch_function__`` implementations compare ``func`` with
  the methods they captured at import (``UninitializedParameter._allowed_methods``: ``func in [torch.Tensor.to,
  ...]``), and dispatch tables keyed by the original find it. (A plain function would be stable and cheaper still,
  but equal to nothing: torch's module_db corpus fails with one.)
- The wrapper types answer pickle and copy by reference, as the original functions and method descriptors do: a
  bare wrapt proxy refuses ``__reduce_ex__``. What they pickle to names torch only, so a pickle made with safetorch
  installed loads where safetorch is not.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

from ._tracebacks import hide_own_frames

__all__ = ["MethodPatch", "Registry", "caller", "is_patch", "registry", "with_globals_of", "wrapt_c_extension"]

_MISSING = object()
Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class _ModuleRef:
    """Pickles as ``importlib.import_module(name)``; only ever used inside a reduce value."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (importlib.import_module, (self.name,))


def _reference(owner: object, name: str) -> tuple[Any, ...]:
    if isinstance(owner, types.ModuleType):
        return (getattr, (_ModuleRef(owner.__name__), name))
    return (getattr, (owner, name))


class BoundPatch(wrapt.BoundFunctionWrapper):
    """What attribute access on a patched method returns (``x.float``, ``torch.Tensor.float``)."""

    __safetorch_patch__ = True

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        parent = self._self_parent
        if self._self_instance is None:
            return parent.__reduce_ex__(protocol)
        return (getattr, (self._self_instance, parent._self_st_name))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)

    def __copy__(self) -> BoundPatch:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> BoundPatch:
        return self


class Patch(wrapt.FunctionWrapper):
    """The wrapper safetorch puts in place of a torch callable; pickles and copies as a reference to it."""

    __bound_function_wrapper__ = BoundPatch
    __safetorch_patch__ = True

    def __init__(self, wrapped: Any, wrapper: Wrapper, owner: object, name: str) -> None:
        super().__init__(wrapped, wrapper)
        self._self_st_owner = owner
        self._self_st_name = name

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _reference(self._self_st_owner, self._self_st_name)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)

    def __copy__(self) -> Patch:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Patch:
        return self


class _Absent:
    """A class attribute that reads as missing: ``hasattr(kind, "__set__")`` is False while the property's setter slot
    stays (assigning ``x.float = f`` raises as before)."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        raise AttributeError("absent")

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError("read-only")


class _MethodPatchType(type):
    """The type of each patch's class: ``inspect.ismethoddescriptor`` (and so ``inspect.isroutine``) reads a patched
    method as the method descriptor it replaces, since its class seems to have ``__get__`` and no ``__set__``."""

    __set__ = _Absent()
    __delete__ = _Absent()


class MethodPatch(property):
    """The replacement of a tensor method (see the module docstring). A subclass defines `calling`, which returns the
    plain function that stands in for the method: ``call(*args, **kwargs)``, where ``args[0]`` is the tensor, whether
    it was called as ``x.float()`` or ``torch.Tensor.float(x)``; `create` builds the patch. It inspects, prints,
    pickles and copies as the method it replaces.

    Why a `property`: ``x.float`` then binds in C (the property calls its getter, ``call.__get__``, which makes the
    same bound method a function attribute would), where a Python ``__get__`` costs a frame on every access; and the
    call itself is a plain function's, not a ``__call__`` slot's. ``torch.Tensor.float(x)`` calls the patch object,
    whose class (one per patch) has ``call`` as its ``__call__``: the same frames either way. What a property changes,
    and nothing found relies on: assigning ``x.float = ...`` on one tensor raises `AttributeError` (a method could be
    shadowed in the instance's ``__dict__``). ``inspect.ismethoddescriptor`` and ``inspect.isroutine`` answer as for
    torch's method (`_MethodPatchType`)."""

    __safetorch_patch__ = True

    @staticmethod
    def calling(wrapped: Any, name: str) -> Callable[..., Any]:
        """The function that replaces ``wrapped`` (the method ``name``): defined by each kind of patch."""
        raise NotImplementedError

    @classmethod
    def create(cls, wrapped: Any, owner: object, name: str) -> MethodPatch:
        call = cls.calling(wrapped, name)
        call.__name__ = name  # a bound method pickles as getattr(tensor, its function's __name__)
        call.__qualname__ = f"{getattr(owner, '__qualname__', name)}.{name}"
        # `inspect.signature(x.register_hook)` and `help(x.float)` read torch's method, not `(*args, **kwargs)`
        call.__wrapped__ = wrapped  # type: ignore[attr-defined]
        call.__doc__ = getattr(wrapped, "__doc__", None)
        # `help(torch.Tensor.float)` names the object's class: torch's name for the method.
        namespace = {"__call__": staticmethod(call), "__slots__": (), "__module__": getattr(owner, "__module__", None)
                     or cls.__module__, "__qualname__": call.__qualname__}
        kind = _MethodPatchType(name, (cls,), namespace)
        return kind(wrapped, owner, name, call)  # type: ignore[no-any-return]

    def __init__(self, wrapped: Any, owner: object, name: str, call: Callable[..., Any]) -> None:
        super().__init__(call.__get__, None, None, getattr(wrapped, "__doc__", None))
        self.__wrapped__ = wrapped
        self.__name__ = name
        self.__qualname__ = f"{getattr(owner, '__qualname__', name)}.{name}"
        self.__objclass__ = getattr(wrapped, "__objclass__", owner)  # the class the method is defined on
        self.__doc__ = getattr(wrapped, "__doc__", None)  # help() reads the instance's own docs
        self._st_owner = owner

    def __eq__(self, other: object) -> bool:
        return other is self or other == self.__wrapped__

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __repr__(self) -> str:
        return repr(self.__wrapped__)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _reference(self._st_owner, self.__name__)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)

    def __copy__(self) -> MethodPatch:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> MethodPatch:
        return self


def wrapt_c_extension() -> bool:
    """True when wrapt's C extension is in use. The checks read their caller as ``sys._getframe(1)``: with the pure
    Python wrapt, wrapt's own frames sit in between and findings would be attributed to wrapt, hence dropped."""
    call = next((k.__dict__["__call__"] for k in wrapt.FunctionWrapper.__mro__ if "__call__" in k.__dict__), None)
    return not isinstance(call, types.FunctionType)


def is_patch(obj: object) -> bool:
    """True for a safetorch wrapper, from this copy of safetorch or any other."""
    if getattr(type(obj), "__safetorch_patch__", False) is True:
        return True
    return isinstance(obj, types.FunctionType) and obj.__dict__.get("__safetorch_patch__") is True


def _namespace(owner: object) -> dict[str, Any]:
    return owner.__dict__  # type: ignore[no-any-return]


def _inherited(owner: object, name: str) -> Any:
    """What ``owner.name`` resolves to without binding: the raw object in the first ``__dict__`` along the MRO."""
    for klass in getattr(owner, "__mro__", (owner,)):
        ns = _namespace(klass)
        if name in ns:
            return ns[name]
    raise AttributeError(f"{owner!r} has no attribute {name!r}")


@dataclass
class _Record:
    owner: object
    name: str
    had: bool  # whether the owner's own __dict__ held the name before this patch
    previous: object  # what it held (None when it did not)
    target: object  # what the patch wraps: ``previous``, or the inherited object
    installed: object
    group: str


def _name_after(function: Any, owner: object, name: str) -> Any:
    """Name a plain-function patch after where it stands, so that it pickles by reference to itself: ``Tensor.float``
    lives on ``torch._C.TensorBase`` (its qualname says so), but the patch stands at ``torch.Tensor.float``."""
    if isinstance(owner, types.ModuleType):
        function.__module__, function.__qualname__ = owner.__name__, name
    else:
        function.__module__ = getattr(owner, "__module__", function.__module__)
        function.__qualname__ = f"{getattr(owner, '__qualname__', getattr(owner, '__name__', name))}.{name}"
    function.__safetorch_patch__ = True
    return function


def with_globals_of(original: Any, function: Any) -> Any:
    """``function`` (whose body reaches its helpers through its closure only) rebuilt with ``original``'s globals:
    TorchScript, compiling a scripted forward's call of the replacement, reads torch's source (``__wrapped__``) and
    resolves its names in the replacement's globals and closure, which must then be torch's module's."""
    rebuilt = types.FunctionType(function.__code__, getattr(original, "__globals__", function.__globals__),
                                 function.__name__, function.__defaults__, function.__closure__)
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    return rebuilt


def _adapter(target: Any, wrapper: Wrapper) -> Any:
    """A class attribute's wrapt-style patch, as a plain function: it binds in C as the original function does (a
    wrapt proxy on a class builds a bound proxy on every access, and a new one on every access through the class),
    and it is one object, so ``nn.Module.load_state_dict is nn.Module.load_state_dict`` holds. It calls
    ``wrapper(wrapped, instance, args, kwargs)`` as wrapt would, reading ``wrapped`` from its own ``__wrapped__`` so
    that the registry can splice a layer out from under it. The wrapper's caller is this function's frame: a wrapper
    that needs the program's frame asks `caller`."""

    def patched(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        try:
            if not args:
                return wrapper(patched.__wrapped__, None, args, kwargs)
            instance = args[0]  # as wrapt does: the wrapper gets the original bound to the instance, and the rest
            return wrapper(patched.__wrapped__.__get__(instance, type(instance)), instance, args[1:], kwargs)
        except BaseException as exc:  # torch's error, or a strict-mode finding: no frame of ours in its traceback
            hide_own_frames(exc)
            raise

    functools.update_wrapper(patched, target)
    return patched


_ADAPTER_CODE = _adapter(print, lambda *a: None).__code__


def caller(depth: int = 1) -> types.FrameType | None:
    """The frame ``depth`` levels above the caller of this function, not counting the frames of class-attribute
    patches (`_adapter`): what a wrapper's ``sys._getframe(1)`` is under wrapt's C extension."""
    frame: types.FrameType | None = sys._getframe(depth + 1)
    while frame is not None and frame.f_code is _ADAPTER_CODE:
        frame = frame.f_back
    return frame


class Registry:
    """Records every attribute safetorch sets, by owner, name and group, and puts back exactly what was there.

    Two checks may wrap the same attribute (``Tensor.backward``): each group adds one layer, and restoring a group
    whose layer is not the outermost splices it out of the chain, leaving the other group's layer in place.
    """

    def __init__(self) -> None:
        self._records: dict[tuple[int, str, str], _Record] = {}
        self._lock = threading.RLock()

    def _ours(self, owner: object, name: str) -> list[_Record]:
        return [r for r in self._records.values() if r.owner is owner and r.name == name]

    def _start(self, owner: object, name: str, group: str, layered: bool) -> tuple[Any, Any]:
        """(what to return because it is in place already, or _MISSING; the object a new patch goes around)."""
        record = self._records.get((id(owner), name, group))
        if record is not None:
            return record.installed, None
        current = _namespace(owner).get(name, _MISSING)
        if current is not _MISSING and is_patch(current):
            if not any(r.installed is current for r in self._ours(owner, name)):
                return current, None  # another copy of safetorch (a reloaded module) already patches it
            if not layered:
                raise ValueError(f"{name} is patched already: a plain replacement must be its first patch")
        return _MISSING, current if current is not _MISSING else _inherited(owner, name)

    def wrap(self, owner: object, name: str, wrapper: Wrapper, group: str) -> Any:
        """Wrap ``owner.name`` with ``wrapper(wrapped, instance, args, kwargs)``; return the patch in place."""
        with self._lock:
            present, target = self._start(owner, name, group, layered=True)
            if present is not _MISSING:
                return present
            if isinstance(owner, type):
                return self._put(owner, name, _name_after(_adapter(target, wrapper), owner, name), group, target)
            return self._put(owner, name, Patch(target, wrapper, owner, name), group, target)

    def replace(self, owner: object, name: str, factory: Callable[[Any], Callable[..., Any]], group: str) -> Any:
        """Put the plain function ``factory(original)`` at ``owner.name``; return what is in place.

        For hot choke points only (see the module docstring). Its closure calls the original directly, so it cannot
        be spliced out from under another layer: it must be the first patch of that attribute.
        """
        with self._lock:
            present, target = self._start(owner, name, group, layered=False)
            if present is not _MISSING:
                return present
            function = factory(target)
            functools.update_wrapper(function, target)
            return self._put(owner, name, _name_after(function, owner, name), group, target)

    def method(self, owner: object, name: str, kind: type[MethodPatch], group: str) -> Any:
        """Put ``kind.create(original, owner, name)`` at ``owner.name``; return what is in place. Like `replace`, it
        must be the first patch of that attribute."""
        with self._lock:
            present, target = self._start(owner, name, group, layered=False)
            if present is not _MISSING:
                return present
            return self._put(owner, name, kind.create(target, owner, name), group, target)

    def set(self, owner: object, name: str, value: Any, group: str) -> Any:
        """Put ``value`` at ``owner.name`` (a plain replacement, for what is not a wrapped callable)."""
        with self._lock:
            record = self._records.get((id(owner), name, group))
            if record is not None:
                return record.installed
            return self._put(owner, name, value, group, _namespace(owner).get(name))

    def _put(self, owner: object, name: str, value: Any, group: str, target: object) -> Any:
        ns = _namespace(owner)
        had = name in ns
        self._records[(id(owner), name, group)] = _Record(owner, name, had, ns.get(name), target, value, group)
        setattr(owner, name, value)
        return value

    def restore(self, group: str | None = None) -> None:
        """Undo the patches of ``group`` (all when None), newest first. Harmless when there is nothing to undo."""
        with self._lock:
            for key, rec in reversed(list(self._records.items())):
                if group is not None and rec.group != group:
                    continue
                del self._records[key]
                current = _namespace(rec.owner).get(rec.name, _MISSING)
                if current is rec.installed:
                    if rec.had:
                        setattr(rec.owner, rec.name, rec.previous)
                    else:
                        delattr(rec.owner, rec.name)
                    continue
                outer = next((r for r in self._ours(rec.owner, rec.name) if r.previous is rec.installed), None)
                if outer is not None:  # another group's layer sits on ours: splice ours out of the chain
                    outer.had, outer.previous, outer.target = rec.had, rec.previous, rec.target
                    if is_patch(outer.installed) and outer.installed.__wrapped__ is rec.installed:
                        outer.installed.__wrapped__ = rec.target
                # else someone else replaced our patch since: theirs stays

    def module_functions(self) -> list[tuple[Any, Any, str]]:
        """For each patched attribute of a module (``torch.nn.utils.clip_grad_norm_``): (torch's own object, what
        stands there now, the group of the outermost layer)."""
        with self._lock:
            by_attribute: dict[tuple[int, str], list[_Record]] = {}
            for rec in self._records.values():
                if isinstance(rec.owner, types.ModuleType) and rec.had:
                    by_attribute.setdefault((id(rec.owner), rec.name), []).append(rec)
            found = []
            for recs in by_attribute.values():
                original = next((r.previous for r in recs if not is_patch(r.previous)), None)
                outer = next((r for r in recs if getattr(r.owner, r.name, None) is r.installed), None)
                if original is not None and outer is not None:
                    found.append((original, outer.installed, outer.group))
            return found

    def groups(self) -> builtins.set[str]:  # `set` in this class is Registry.set
        return {rec.group for rec in self._records.values()}

    def touched(self) -> list[tuple[object, str]]:
        return [(rec.owner, rec.name) for rec in self._records.values()]


registry = Registry()
