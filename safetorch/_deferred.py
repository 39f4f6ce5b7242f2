"""Checks of a value that lives on an accelerator, read without ever making the host wait for the device.

A check that needs a device tensor's value (is the loss finite? is the AMP scale larger than the clip limit?) hands
a 0-dim tensor, or one of two elements, to `check` with a callback. On the CPU the value is read at once and the
callback runs. On an accelerator the value is copied without blocking into a slot of a small ring of host memory
(pinned, allocated once per device), an event is recorded after the copy on the tensor's current stream, and the
callback runs when `poll` finds that event completed: ST006 polls at every backward, and everything still pending is
waited for at exit. A slot is never read before its event has completed, so the program's stream never waits for
safetorch; the per-step work is the copy, the event and O(1) Python. When every slot of a device is still in flight
(the device more than `RING` checks behind the host), the value is not checked and `dropped` counts it: a check
that would wait is worse than a check skipped.

What only a device has (pinned memory, events, streams) is an adapter: CUDA's (ROCm included), and `_Fake`, which
makes CPU tensors take the accelerator path, so that CI runs, tests and benches the very lines a GPU run runs
(`force_cpu`, or ``SAFETORCH_DEFERRED_CPU=1`` in the environment, an internal switch for tests and the bench). Its
events complete `lag` recorded events later, as those of a device running behind the host would. Other accelerator
types (MPS, XPU) are not checked on the device: their values are left unread rather than read with a wait.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RING", "check", "clear", "dropped", "force_cpu", "host_buffers", "pending", "poll"]

#: Slots per device: checks in flight at once. ST006 queues one per backward; a device this far behind is rare.
RING = 64

#: ``ready(value, payload)``: ``value`` is a float (a 0-dim tensor was checked) or a list of two floats.
Ready = Callable[[Any, Any], None]

FORCED = os.environ.get("SAFETORCH_DEFERRED_CPU", "") == "1"


class _Fake:
    """The adapter that makes CPU tensors take the accelerator path. Its events complete once `lag` more events have
    been recorded after them (or when synchronised): a device that runs `lag` checks behind the host."""

    lag = 1
    recorded = 0
    done = 0  # the last event synchronised

    @staticmethod
    def buffer(rows: int) -> torch.Tensor:
        return torch.zeros(rows, 2, dtype=torch.float32)

    @staticmethod
    def event() -> _FakeEvent:
        return _FakeEvent()

    @staticmethod
    def stream(device: torch.device) -> None:
        return None


class _FakeEvent:
    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0

    def record(self, stream: Any = None) -> None:
        _Fake.recorded += 1
        self.seq = _Fake.recorded

    def query(self) -> bool:
        return self.seq <= max(_Fake.recorded - _Fake.lag, _Fake.done)

    def synchronize(self) -> None:
        _Fake.done = max(_Fake.done, self.seq)


class _Cuda:
    """CUDA's adapter: a pinned buffer (a non-blocking copy into pageable memory would block) and CUDA events."""

    @staticmethod
    def buffer(rows: int) -> torch.Tensor:
        return torch.zeros(rows, 2, dtype=torch.float32, pin_memory=True)

    @staticmethod
    def event() -> Any:
        return torch.cuda.Event()

    @staticmethod
    def stream(device: torch.device) -> Any:
        return torch.cuda.current_stream(device)


class _Slot:
    __slots__ = ("scalar", "pair", "event", "ready", "payload", "owner", "pairwise")

    def __init__(self, row: torch.Tensor, event: Any) -> None:
        self.scalar, self.pair, self.event = row[0], row, event
        self.ready: Ready | None = None
        self.payload: Any = None
        self.owner = ""
        self.pairwise = False


class _Ring:
    """One device's slots: `free` ones, and `pending` ones in the order their events were recorded."""

    __slots__ = ("adapter", "buffer", "free", "pending")

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.buffer = adapter.buffer(RING)
        self.free = [_Slot(self.buffer[i], adapter.event()) for i in range(RING)]
        self.pending: deque[_Slot] = deque()


_rings: dict[torch.device, _Ring] = {}
_lock = threading.Lock()
#: Whether any ring has a slot in flight: what every poll site reads first.
pending = False
dropped = 0


def _adapter(device: torch.device) -> Any:
    if device.type == "cuda":
        return _Cuda
    if device.type == "cpu" and FORCED:
        return _Fake
    return None


def _ring(device: torch.device) -> _Ring | None:
    ring = _rings.get(device)
    if ring is None:
        adapter = _adapter(device)
        if adapter is None:
            return None
        ring = _rings[device] = _Ring(adapter)
    return ring


def is_deferred(t: torch.Tensor) -> bool:
    """Whether a check of ``t``'s value takes the accelerator path (a CUDA tensor, or any with `force_cpu` on)."""
    return not t.is_cpu or FORCED


def check(value: torch.Tensor, ready: Ready, payload: Any, owner: str) -> bool:
    """Call ``ready(v, payload)`` with ``value``'s content (a float for a 0-dim tensor, two floats for a pair): now
    on the CPU, once the device has computed it on an accelerator. ``value`` must not require grad. False when it
    could not be queued (a device type without an adapter, or every slot in flight)."""
    global pending, dropped
    if value.is_cpu and not FORCED:
        ready(value.tolist(), payload)
        return True
    if value.is_meta:
        return False
    ring = _ring(value.device)
    if ring is None:
        return False
    with _lock:
        done = _poll_ring(ring, False) if not ring.free else []
        queued = bool(ring.free)
        if queued:
            slot = ring.free.pop()
            slot.ready, slot.payload, slot.owner, slot.pairwise = ready, payload, owner, value.dim() > 0
            (slot.pair if slot.pairwise else slot.scalar).copy_(value, non_blocking=True)
            slot.event.record(ring.adapter.stream(value.device))
            ring.pending.append(slot)
            pending = True
        else:
            dropped += 1
    _run(done)
    return queued


def _poll_ring(ring: _Ring, wait: bool) -> list[tuple[Ready, Any, Any]]:
    """Take the slots whose event completed (all, waiting for them, when ``wait``), oldest first; the caller holds
    the lock and calls what this returns without it."""
    done = []
    while ring.pending:
        slot = ring.pending[0]
        if wait:
            slot.event.synchronize()
        elif not slot.event.query():
            break  # one stream completes in order: what was recorded after it is not complete either
        ring.pending.popleft()
        value = slot.pair.tolist() if slot.pairwise else slot.scalar.item()  # host memory the device has written
        if slot.ready is not None:
            done.append((slot.ready, value, slot.payload))
        slot.ready = slot.payload = None
        ring.free.append(slot)
    return done


def poll(wait: bool = False) -> None:
    """Run the callbacks of the checks whose value the device has computed (of all of them, waiting, when ``wait``:
    at exit)."""
    global pending
    if not pending:
        return
    with _lock:
        done = []
        for ring in list(_rings.values()):
            done += _poll_ring(ring, wait)
        pending = any(ring.pending for ring in _rings.values())
    _run(done)


def _run(done: list[tuple[Ready, Any, Any]]) -> None:
    """Call the callbacks of completed checks. One may raise (strict mode): the others still run, and the first
    error is raised after them."""
    error: BaseException | None = None
    for ready, value, payload in done:
        try:
            ready(value, payload)
        except BaseException as exc:  # noqa: BLE001  (strict mode's SafetorchError, raised after the others ran)
            error = error or exc
    if error is not None:
        raise error


def clear(owner: str | None = None) -> None:
    """Forget the pending checks of ``owner`` (all when None): their callbacks never run."""
    with _lock:
        for ring in _rings.values():
            for slot in ring.pending:
                if owner is None or slot.owner == owner:
                    slot.ready = slot.payload = None


def force_cpu(on: bool, lag: int = 1) -> None:
    """Make CPU tensors take the accelerator path (tests, the bench), with a fake device `lag` events behind."""
    global FORCED, pending
    with _lock:
        FORCED = on
        _Fake.lag, _Fake.recorded, _Fake.done = lag, 0, 0
        _rings.pop(torch.device("cpu"), None)
        pending = any(ring.pending for ring in _rings.values())


def host_buffers() -> list[torch.Tensor]:
    """The host memory the rings read (for the tests that fail on any read of a device tensor)."""
    return [ring.buffer for ring in _rings.values()]


def _after_fork_in_child() -> None:
    """A forked child has no device context of its own (CUDA cannot be used in it): its parent's slots are the
    parent's to read."""
    global pending, _lock
    _lock = threading.Lock()  # the parent may have held it while forking
    _rings.clear()
    pending = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
