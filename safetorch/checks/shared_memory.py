"""ST022: a tensor that shares memory with a NumPy array (``torch.from_numpy``, ``torch.as_tensor``) changed in place,
changing the array; or one reused buffer kept as many tensors.

``torch.from_numpy(a)`` (and ``torch.as_tensor(a)`` of a CPU array of a torch dtype) makes no copy: the tensor is the
array's memory. Two programs go wrong with it:

- A dataset whose ``__getitem__`` returns ``torch.from_numpy(self.data[i])``, normalised in place afterwards
  (``x.sub_(mean).div_(std)``): the stored data is normalised again every epoch. Each converted tensor is watched
  until it dies (a ``detach()`` of it shares its version counter, and its storage: nothing more is kept alive); if
  it was changed in place, the changed memory is remembered with a sample of its bytes, and when the same line
  converts the same memory again, still holding those bytes, the finding is made: the line reads back what an
  in-place operation wrote into the array.
- A loader that fills one buffer and keeps ``torch.from_numpy(buf)`` for each batch: every kept tensor is the same
  memory and shows the last fill. Found when the same line converts the same memory while two or more tensors it
  made from it earlier are alive and the buffer's bytes have changed since (one earlier tensor alive is a streaming
  loop's previous batch, still bound to its name: silent).

Silent: read-only use; a ``.clone()`` or ``.copy()`` (a tensor or an array of its own); in-place work on tensors
that own their memory (``torch.tensor(a)``); an array converted once (in-place work on it is then the program's
intent); ``as_tensor`` that copied; conversions inside torch (``default_collate``'s) and under ``torch.compile``.
The finding is at the conversion's line, the one to change.

Cost: the first `WATCH` conversions at a line are watched (a sample of the bytes, a weak reference, a ``detach()``);
after them a conversion only looks its memory up among the regions changed in place.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch

from .._callsite import quoted_call
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, is_internal, report
from .._rule import Rule

CODE = "ST022"


class SharedMemoryWarning(SafetorchWarning):
    """ST022: a tensor sharing memory with a NumPy array changed the array in place, or a reused buffer was kept."""

    code = "ST022"


RULE = Rule("ST022", "shared-memory", SharedMemoryWarning,
            "a tensor sharing memory with a NumPy array (from_numpy, as_tensor) changed in place, changing the "
            "array, or one reused buffer kept as many tensors")

#: Per site: the regions remembered (changed in place, or converted), beyond which the older half is dropped.
MAX_REGIONS = 1 << 14
#: Earlier tensors over the same buffer kept alive, while it was refilled, that make a reused-buffer finding.
KEPT = 2
#: Bytes an array's sample holds: small arrays whole, larger ones by 16 elements spread over them.
_WHOLE = 256
_SAMPLES = 16
_is_compiling = is_compiling
_getframe = sys._getframe
_as_tensor = torch._C._VariableFunctions.as_tensor  # torch's builtin, whatever ``torch.as_tensor`` is now


#: Conversions watched per line (a sample of the bytes, a weak reference, a ``detach()``): a reused buffer shows by the
#: third, and a dataset's drift is seen when any of the first items converted comes round again. Later conversions
#: at the line only look up whether their memory is one that was changed in place.
WATCH = 64


class _Site:
    """One conversion line: the memory changed in place through its tensors, and the tensors it made, by region."""

    __slots__ = ("changed", "kept", "watched")

    def __init__(self) -> None:
        self.changed: dict[tuple[int, int], bytes] = {}
        self.kept: dict[tuple[int, int], list[tuple[weakref.ref[torch.Tensor], bytes]]] = {}
        self.watched = 0


class _State:
    """The one owner of ST022's state: its sites (``id(code) + offset`` → (code, site)), cleared by `uninstall`."""

    def __init__(self) -> None:
        self.sites: dict[int, tuple[Any, _Site]] = {}

    def clear(self) -> None:
        self.sites.clear()


_state = _State()


def _trim(cache: dict[Any, Any]) -> None:
    if len(cache) > MAX_REGIONS:
        for key in list(cache)[: len(cache) // 2]:
            cache.pop(key, None)


_indices: dict[int, Any] = {}


def _sample(a: Any) -> bytes:
    """A few of the array's bytes: all of a small array, 16 elements spread over a larger one (O(1))."""
    if a.nbytes <= _WHOLE:
        return a.tobytes()
    index = _indices.get(a.size)
    if index is None:
        import numpy as np

        if len(_indices) > 64:
            _indices.clear()
        index = _indices[a.size] = np.linspace(0, a.size - 1, _SAMPLES).astype(np.intp)
    return bytes(a.flat[index].tobytes())


class _Watch:
    """The weak reference's callback for one converted tensor: when it dies, was it changed in place? ``twin`` (its
    ``detach()``) shares its version counter and its storage; both references are dropped once it has looked."""

    __slots__ = ("array", "key", "site", "twin")

    def __init__(self, twin: torch.Tensor, array: Any, key: tuple[int, int], site: _Site) -> None:
        self.twin: torch.Tensor | None = twin
        self.array, self.key, self.site = array, key, site

    def __call__(self, _ref: Any) -> None:
        twin, array = self.twin, self.array
        self.twin = self.array = None
        try:
            if twin is not None and twin._version > 0:
                _trim(self.site.changed)
                self.site.changed[self.key] = _sample(array)
        except Exception as exc:
            internal_error(CODE, exc)


def _shares(result: Any, a: Any, api: str) -> bool:
    """``from_numpy`` always shares; ``as_tensor`` only without a copy (the array's dtype, on the CPU)."""
    if not isinstance(result, torch.Tensor) or a.size == 0:
        return False
    return api == "from_numpy" or result.data_ptr() == a.__array_interface__["data"][0]


def _converting(original: Any, api: str) -> Any:
    """``torch.from_numpy`` / ``torch.as_tensor``: a plain function (see `Registry.replace`) that calls torch first,
    unguarded, then looks at a NumPy array converted without a copy."""

    def convert(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        if _is_compiling():
            # Dynamo inlines this function when it was imported before safetorch (its table of torch functions then
            # holds torch's builtins, not this one): torch's own ``as_tensor`` is in that table, and is what dynamo
            # itself puts in the graph for ``from_numpy`` (the same tensor, sharing the array's memory).
            return _as_tensor(*args, **kwargs)
        result = original(*args, **kwargs)
        try:
            a = args[0] if args else kwargs.get("data", kwargs.get("ndarray"))
            np = sys.modules.get("numpy")
            if np is not None and isinstance(a, np.ndarray) and _shares(result, a, api):
                frame = _getframe(1)
                if not is_internal(frame.f_code):
                    _converted(frame, a, result, api)
        except Exception as exc:  # strict-mode findings pass through internal_error
            internal_error(CODE, exc)
        return result

    return convert


def _converted(frame: FrameType, a: Any, result: torch.Tensor, api: str) -> None:
    code = frame.f_code
    entry = _state.sites.get(id(code) + frame.f_lasti)
    if entry is None or entry[0] is not code:
        _trim(_state.sites)
        entry = _state.sites[id(code) + frame.f_lasti] = (code, _Site())
    site = entry[1]
    key = (result.data_ptr(), a.nbytes)
    changed = site.changed.get(key)
    if changed is not None and changed == _sample(a):
        del site.changed[key]
        report(CODE, frame, lambda: _changed_message(frame, api))
    if site.watched >= WATCH:
        return
    site.watched += 1
    now = _sample(a)
    earlier = [e for e in site.kept.get(key, ()) if e[0]() is not None]
    stale = sum(1 for _, sample in earlier if sample != now)
    if stale >= KEPT:
        report(CODE, frame, lambda: _kept_message(frame, api, stale))
    _trim(site.kept)
    site.kept[key] = [*earlier[-7:], (weakref.ref(result, _Watch(result.detach(), a, key, site)), now)]


def _call(frame: FrameType, api: str) -> str:
    return quoted_call(frame, f"torch.{api}(...)").strip("`")


def _changed_message(frame: FrameType, api: str) -> str:
    call = _call(frame, api)
    return (f"{CODE} {call} returns a tensor over the array's own memory, and the tensor this line made from it "
            f"before was changed in place (an in-place operation such as x.sub_(mean).div_(std)), which changed the "
            f"array: this line now reads the changed data back, and every pass (every epoch) changes it again. "
            f"Write: {call}.clone(), or make the in-place operations out of place (x = (x - mean) / std)")


def _kept_message(frame: FrameType, api: str, kept: int) -> str:
    call = _call(frame, api)
    return (f"{CODE} {call} returns a tensor over the array's own memory, and {kept} tensors this line made from the "
            f"same array are still kept while it has been refilled since: they are all that one buffer, and all "
            f"show its last contents (identical batches). Write: {call}.clone()")


def install(registry: Registry) -> None:
    registry.replace(torch, "from_numpy", lambda original: _converting(original, "from_numpy"), CODE)
    registry.replace(torch, "as_tensor", lambda original: _converting(original, "as_tensor"), CODE)


def uninstall() -> None:
    _state.clear()
