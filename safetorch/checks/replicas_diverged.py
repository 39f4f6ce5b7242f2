"""ST016: parameters that must be identical on every rank differ across ranks: a DistributedDataParallel model
whose replicas diverged (BLOOM-176B's weights drifted apart for 15 days before anyone noticed).

What is compared: the parameters of each DDP wrapper (not its buffers: ``broadcast_buffers`` and rank-local buffers
differ legitimately; not the ``parameters_to_ignore``), among the ranks of the wrapper's own process group (the ranks
of a model-parallel or pipeline layout hold different modules, each replicated only within its data-parallel group).

When: at the optimizer steps the shared step hook looks at (`safetorch._steps`: an optimizer's first 8 steps, then
two steps every 1024 backwards), before the step. A fingerprint is taken: for each parameter, the float64 sum of 16
strided elements (``segment_reduce`` over one ``cat``: a few kernels, 8 bytes per parameter). Fingerprints are matched
by the wrapper's count of synchronising forwards (`safetorch._ddp`), which is the same step on every rank, so a rank
that does something else between steps (an extra evaluation, a different number of samples in its window) is never
compared with another step's weights: unmatched fingerprints are simply not compared.

How, without a collective: each rank writes its fingerprint into the job's rendezvous store (the default process
group's, a key per rank and step, one ``set``); the group's lowest rank (rank 0 for a plain DDP job) checks with
``store.check`` — which never waits — whether every other rank's fingerprint of that step is there, reads them when
they are, compares them bit for bit, and deletes the keys. Nothing blocks and nothing is issued that another rank must
match, so a rank that stops stepping early (an uneven last epoch, ``Join``), crashes or is slower cannot hang or
desynchronise the job: its missing fingerprints just leave those steps uncompared. On an accelerator the fingerprint
reaches the host by a non-blocking copy into pinned memory and an event; it is written once the event has completed
(at a later looked-at step, before ``destroy_process_group()``, or at exit), so the host never waits for the device.

Reported once per job, by the comparing rank, at that rank's ``step()`` line of the first step whose fingerprints
differ, naming the first parameter that differs, the ranks that differ, and the last step at which they matched.
"""

from __future__ import annotations

import atexit
import hashlib
import struct
from collections import deque
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.optim import Optimizer

from .. import _ddp, _deferred, _steps
from .._callsite import Spot
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, report_at, user_frame
from .._rule import Rule

CODE = "ST016"
_K = 16  # elements summed per parameter
_KEEP = 16  # fingerprints a rank remembers (published, not yet compared)
_PREFIX = "safetorch/ST016"


class ReplicasDivergedWarning(SafetorchWarning):
    """ST016: parameters that must be identical on every rank (DDP replicas) differ across ranks."""

    code = "ST016"


RULE = Rule("ST016", "replicas-diverged", ReplicasDivergedWarning,
            "parameters that must be identical on every rank (DDP replicas) differ across ranks")


@dataclass(eq=False)
class _Print:
    syncs: int
    spot: Spot
    host: torch.Tensor  # float64 sums, one per parameter (written by the device once `event` has completed)
    event: Any = None
    published: bool = False


@dataclass(eq=False)
class _State:
    names: list[str]
    group: str
    prints: deque[_Print] = field(default_factory=lambda: deque(maxlen=_KEEP))
    last_syncs: int = -1
    last_equal: int | None = None
    done: bool = False
    lengths: dict[tuple[Any, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)


def _store() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def _key(state: _State, syncs: int, rank: int) -> str:
    return f"{_PREFIX}/{state.group}/{syncs}/{rank}"


def _state(entry: _ddp.Wrapped) -> _State | None:
    state = entry.state.get(CODE)
    if state is None:
        ddp = entry.ddp()
        if ddp is None:
            return None
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        names = [name for name, p in ddp.module.named_parameters() if name not in ignored and p.numel()]
        group = hashlib.sha1(repr((entry.index, entry.ranks)).encode()).hexdigest()[:12]
        state = entry.state[CODE] = _State(names, group)
    return state


def _fingerprint(entry: _ddp.Wrapped, state: _State, spot: Spot) -> None:
    ddp = entry.ddp()
    if ddp is None:
        return
    wanted = set(state.names)
    params = [p for name, p in ddp.module.named_parameters() if name in wanted]
    if len(params) != len(state.names) or not params or len({p.device for p in params}) != 1:
        return  # parameters added or removed since, or spread over devices: not compared
    with torch.no_grad():
        flats = [p.detach().reshape(-1) for p in params]
        slices = [f[:: max(1, f.numel() // _K)][:_K] for f in flats]
        lengths = tuple(s.numel() for s in slices)
        device = params[0].device
        index = state.lengths.get((device, lengths))
        if index is None:
            state.lengths.clear()
            index = state.lengths[(device, lengths)] = torch.tensor(lengths, device=device)
        sums = torch.segment_reduce(torch.cat(slices).to(torch.float64), "sum", lengths=index)
    if sums.is_cpu and not _deferred.FORCED:
        state.prints.append(_Print(entry.syncs, spot, sums))
        return
    adapter = _deferred._Cuda if sums.is_cuda else _deferred._Fake if sums.is_cpu else None
    if adapter is None:
        return  # an accelerator without an adapter: not read rather than read with a wait
    host = torch.empty(sums.shape, dtype=torch.float64, pin_memory=sums.is_cuda)
    host.copy_(sums, non_blocking=True)
    event = adapter.event()
    adapter.record(event, sums)
    state.prints.append(_Print(entry.syncs, spot, host, event))


def _pack(host: torch.Tensor) -> bytes:
    values = host.tolist()
    return struct.pack(f"<{len(values)}d", *values)


def _flush(entry: _ddp.Wrapped, state: _State, wait: bool = False) -> None:
    """Publish the fingerprints the device has computed; on the comparing rank, compare every step all ranks have
    published."""
    store = _store()
    if store is None:
        return
    for pr in state.prints:
        if pr.published:
            continue
        if pr.event is not None:
            if wait:
                pr.event.synchronize()
            elif not pr.event.query():
                break  # one stream completes in order
        store.set(_key(state, pr.syncs, entry.rank), _pack(pr.host))
        pr.published = True
    if entry.rank != min(entry.ranks, default=entry.rank):
        return
    others = [r for r in entry.ranks if r != entry.rank]
    for pr in [p for p in state.prints if p.published]:
        keys = [_key(state, pr.syncs, r) for r in others]
        if keys and not store.check(keys):
            continue
        mine = _pack(pr.host)
        got = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
        theirs = {r: bytes(v) for r, v in zip(others, got, strict=True)}
        for k in (*keys, _key(state, pr.syncs, entry.rank)):
            _delete(store, k)
        state.prints.remove(pr)
        differ = sorted(r for r, v in theirs.items() if v != mine)
        if not differ:
            state.last_equal = pr.syncs
            continue
        state.done = True
        _report(entry, state, pr, differ, theirs[differ[0]], mine)
        return


def _delete(store: Any, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # a store without deletion keeps a few hundred bytes a step
        pass


def _report(entry: _ddp.Wrapped, state: _State, pr: _Print, differ: list[int], theirs: bytes, mine: bytes) -> None:
    __tracebackhide__ = True  # noqa: F841
    n = len(mine) // 8
    a, b = struct.unpack(f"<{n}d", mine), struct.unpack(f"<{n}d", theirs)
    first = next((i for i in range(n) if struct.pack("<d", a[i]) != struct.pack("<d", b[i])), 0)
    name = state.names[first] if first < len(state.names) else "?"
    ranks = ", ".join(str(r) for r in differ)
    if state.last_equal is None:
        since = "the first step compared"
    elif state.last_equal == pr.syncs - 1:
        since = f"identical when step {state.last_equal} began: its update made them differ"
    else:
        since = (f"identical when step {state.last_equal} began: an update of steps {state.last_equal}-"
                 f"{pr.syncs - 1} made them differ")
    spot = pr.spot

    def message() -> str:
        return (f"{CODE} the replicas of the DistributedDataParallel model differ across ranks when step {pr.syncs} "
                f"begins: `{name}` (and maybe more) on rank{'s' if len(differ) > 1 else ''} {ranks} is not rank "
                f"{entry.rank}'s ({since}; steps count the forwards through the wrapper). DDP keeps replicas "
                f"identical only if every rank applies the same update: "
                f"look for rank-dependent code between backward() and step() (clipping, scaling or skipping a step "
                f"on some ranks only, a rank-local learning rate or random state), or parameters changed in place "
                f"on one rank; call the wrapper for every training forward")

    report_at(CODE, spot.f_code.co_filename, spot.f_lineno, spot.f_globals, message)


def _look(optimizer: Optimizer, look: int, caller: FrameType, more: bool) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        if not _ddp.live:
            return
        entries = _ddp.holding(p for group in optimizer.param_groups for p in group["params"])
        if not entries:
            return
        frame = user_frame(caller)
        if frame is None:
            return
        for entry in entries:
            state = _state(entry)
            if state is None or state.done or len(entry.ranks) < 2:
                continue
            if entry.syncs and entry.syncs != state.last_syncs:
                state.last_syncs = entry.syncs
                _fingerprint(entry, state, Spot(frame))
            _flush(entry, state)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _final() -> None:
    """Before the process group goes (``destroy_process_group()``) and at exit: publish and compare what is left,
    without waiting for any other rank."""
    for entry in list(_ddp.live.values()):
        state = entry.state.get(CODE)
        if state is not None and not state.done:
            try:
                _flush(entry, state, wait=True)
            except Exception as exc:
                internal_error(CODE, exc)


def _destroying(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    group = args[0] if args else kwargs.get("group")
    if group is None:
        _final()
    return wrapped(*args, **kwargs)


_exit_registered = [False]


def _new(entry: _ddp.Wrapped) -> None:
    if not _exit_registered[0]:
        atexit.register(_final)  # after install's exit summary was registered: runs before it
        _exit_registered[0] = True


def _gone(entry: _ddp.Wrapped) -> None:
    """A wrapper goes (garbage-collected): compare what it published last, without waiting. Called from a finalizer:
    a strict-mode finding is recorded for the summary and the report, not raised into the collector."""
    state = entry.state.get(CODE)
    if state is not None and not state.done:
        try:
            _flush(entry, state, wait=True)
        except Exception:
            pass


def install(registry: Registry) -> None:
    if not torch.distributed.is_available():
        return
    import torch.distributed as dist

    _ddp.listen(CODE, _new, _gone)
    _steps.listen(CODE, _look)
    registry.wrap(dist, "destroy_process_group", _destroying, CODE)


def uninstall() -> None:
    _steps.unlisten(CODE)
    _ddp.unlisten(CODE)
    for entry in _ddp.live.values():
        entry.state.pop(CODE, None)
