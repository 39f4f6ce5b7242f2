"""Tensor hooks on parameters that leave nothing behind once removed.

torch keeps a parameter's Python tensor hooks in one dict (``param._backward_hooks``) that a single C++ pre-hook
reads at every backward reaching the parameter. ``handle.remove()`` empties the dict but leaves that pre-hook in place:
from then on every backward takes the GIL, wraps the incoming gradient in a Python object and iterates an empty dict
for the parameter, and the gradient can no longer be stolen by the accumulation (it is copied instead). A check that
watches a parameter for one step interval would make every later step pay for it (safetorch's share of a tiny-MLP
training step: 16.7k instructions with the runner left behind, 10.1k without it; callgrind, one hash seed).

`LeafHook` registers through torch's ``register_hook`` and, once removed, puts the parameter back as it found it:
when the dict did not exist before and is empty again, ``param._backward_hooks = None`` (torch's own setter, which
drops the C++ pre-hook; torch's first ``register_hook`` on a tensor goes through the same setter). A parameter that
had a dict before, or holds someone else's hook now, is left alone.

The C++ pre-hook must not be dropped while it runs (it is the caller of our hook), and a removal can come from
anywhere: from inside the hook, or from a ``weakref.finalize`` callback that a garbage collection runs in the middle
of a backward. So `remove` only takes the hook out of the dict and queues the parameter; `settle` puts the queued
parameters back, and is called only where no backward of ours can be running: the checks' step hooks, their backward
listeners (before torch's backward starts), after a ``step(closure)``'s closure, and at uninstall.

Every hook safetorch registers goes through `untallied`: torch numbers hook handles from one global counter
(``RemovableHandle.next_id``), which a program can see (a tutorial printing its handles' ids); ours are filed under
keys of their own (negative, which torch never gives) and the counter is put back, so the program's handles get
the numbers they get without safetorch.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.hooks import RemovableHandle, unserializable_hook

__all__ = ["LeafHook", "settle", "untallied"]

_Handle = TypeVar("_Handle")
#: The keys of our hooks in torch's hook dicts: negative, where torch counts up from 0.
_keys = itertools.count(-1, -1)


def untallied(register: Callable[..., _Handle], *args: Any, **kwargs: Any) -> _Handle:
    """``register(*args, **kwargs)`` (a hook registration that appends: never ``prepend=True``) without moving
    torch's global handle counter: the new handle's entry is filed under a key of ours in its dicts, and the counter
    is put back. A registration that did not take exactly the next number (another thread's in between, a handle of
    another kind) is left as torch made it."""
    before = RemovableHandle.next_id
    handle = register(*args, **kwargs)
    try:
        if isinstance(handle, RemovableHandle) and handle.id == before and RemovableHandle.next_id == before + 1:
            key = next(_keys)
            refs = (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ()))
            for ref in refs:
                hooks = ref()
                if hooks is not None and before in hooks:
                    hooks[key] = hooks.pop(before)  # it was the last entry, and stays the last
            handle.id = key
            RemovableHandle.next_id = before
    except Exception:  # a torch whose handles look otherwise: the numbers move, as they did
        pass
    return handle

#: Our hooks running now (any thread): while one does, removals are queued.
_inside = 0
#: Parameters whose dict we created and whose last hook of ours was removed, to be put back.
_queued: list[weakref.ref[torch.Tensor]] = []


class LeafHook:
    """``param.register_hook(fn)`` whose `remove` also takes torch's per-parameter hook runner away when nothing
    else uses it. Holds the parameter weakly."""

    __slots__ = ("_handle", "_param", "_created")

    def __init__(self, param: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> None:
        self._param = weakref.ref(param)
        self._created = param._backward_hooks is None

        @unserializable_hook
        def hook(grad: torch.Tensor) -> Any:
            global _inside
            _inside += 1
            try:
                return fn(grad)
            finally:
                _inside -= 1

        self._handle: Any = untallied(param.register_hook, hook)

    def remove(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        handle.remove()
        if self._created:
            _queued.append(self._param)  # put back by the next `settle`


def settle() -> None:
    """Put back the parameters queued by removals. Call it only where no backward is running (a no-op inside one of
    our hooks, as a guard)."""
    if _inside:
        return
    while _queued:
        param = _queued.pop()()
        if param is None:
            continue
        try:
            hooks = param._backward_hooks
            if hooks is not None and not hooks:
                param._backward_hooks = None
        except Exception:  # a tensor subclass that forbids it keeps the empty dict: slower steps, nothing else
            pass
