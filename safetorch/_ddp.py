"""The DistributedDataParallel wrappers alive in this process, as ST016 and ST017 see them.

Design rules: nothing here runs for a program that builds no DDP wrapper. DDP's ``_ddp_init_helper`` (the end of its
construction; ``__init__`` on a torch without it) is wrapped, once per model, to record each wrapper — not
``__init__`` itself, whose own warnings (``broadcast_buffers`` is deprecated …) name their caller by stack level, which
a wrapper's frame would become: its place in the order the wrappers over its process
group were built (every rank builds them in the same order: the construction itself is a collective), the global ranks
of that group, and the inner module. ``DistributedDataParallel.forward`` is wrapped to count the forwards that will
synchronise gradients (grad enabled, not under ``no_sync()``): every rank of the group makes the same number of them,
since each pairs with every other rank's all-reduce, which makes the count a step number that means the same on every
rank, whatever else a rank does between steps. The same hooks know when a DDP forward is in progress (ST017). An
entry goes with its wrapper (a finalizer); listeners hear of each new one.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._compat import is_compiling
from ._hooks import untallied
from ._patch import registry
from ._report import internal_error

GROUP = "core:ddp"


@dataclass(eq=False)
class Wrapped:
    ddp: weakref.ref[torch.nn.Module]
    module: weakref.ref[torch.nn.Module]
    #: The n-th wrapper built over this process group in this process (the same on every rank of the group).
    index: int
    #: The global ranks of the wrapper's process group, and this process's.
    ranks: tuple[int, ...]
    rank: int
    #: ``id`` of every parameter the wrapper holds (at wrapping).
    params: frozenset[int]
    #: Forwards through the wrapper that synchronise gradients, so far.
    syncs: int = 0
    #: DDP forwards of this wrapper in progress (its inner module's forward then runs through the wrapper).
    depth: int = 0
    #: What the checks keep about this wrapper, by code.
    state: dict[str, Any] = field(default_factory=dict)


#: id(wrapper) -> its entry, and id(inner module) -> the same entry.
live: dict[int, Wrapped] = {}
inner: dict[int, Wrapped] = {}
_order: dict[tuple[int, ...], itertools.count[int]] = {}
_listeners: dict[str, tuple[Callable[[Wrapped], None], Callable[[Wrapped], None]]] = {}


def _ddp_class() -> Any:
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _forget(key: int, module_key: int, entry: Wrapped) -> None:
    if live.get(key) is entry:
        del live[key]
    if inner.get(module_key) is entry:
        del inner[module_key]
    for _, gone in list(_listeners.values()):
        try:
            gone(entry)
        except Exception as exc:
            internal_error("ST017", exc)


def _constructed(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if id(instance) in live and live[id(instance)].ddp() is instance:
        return result  # torch re-runs the helper (static graph, a rebuild): the wrapper is known
    try:
        import torch.distributed as dist

        module = instance.module
        group = getattr(instance, "process_group", None)
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        entry = Wrapped(weakref.ref(instance), weakref.ref(module), next(_order.setdefault(ranks, itertools.count())),
                        ranks, dist.get_rank(), frozenset(id(p) for p in instance.parameters()))
        live[id(instance)] = entry
        inner[id(module)] = entry
        entry.state["hooks"] = (untallied(instance.register_forward_pre_hook, _pre),
                                untallied(instance.register_forward_hook, _post, always_call=True))
        weakref.finalize(instance, _forget, id(instance), id(module), entry)
        for new, _ in list(_listeners.values()):
            new(entry)
    except Exception as exc:
        internal_error("ST016", exc)
    return result


def _pre(ddp: Any, args: Any) -> None:
    entry = live.get(id(ddp))
    if entry is None or is_compiling():
        return
    if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        entry.syncs += 1
    entry.depth += 1


def _post(ddp: Any, args: Any, output: Any) -> None:
    entry = live.get(id(ddp))
    if entry is not None and entry.depth and not is_compiling():
        entry.depth -= 1


def listen(code: str, new: Callable[[Wrapped], None], gone: Callable[[Wrapped], None]) -> None:
    """Hear of each wrapper built from now on (``new``) and of each that goes (``gone``)."""
    ddp = _ddp_class()
    if ddp is None:
        return
    _listeners[code] = (new, gone)
    registry.wrap(ddp, "_ddp_init_helper" if hasattr(ddp, "_ddp_init_helper") else "__init__", _constructed, GROUP)


def unlisten(code: str) -> None:
    _listeners.pop(code, None)
    if not _listeners:
        registry.restore(GROUP)
        for entry in live.values():
            for handle in entry.state.pop("hooks", ()):
                handle.remove()
        live.clear()
        inner.clear()


def holding(params: Any) -> list[Wrapped]:
    """The live wrappers that hold one of ``params`` (an optimizer's), each once."""
    if not live:
        return []
    ids = {id(p) for p in params}
    return [entry for entry in live.values() if not entry.params.isdisjoint(ids)]
