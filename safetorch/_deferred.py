"""Checks of a value that lives on an accelerator, read without ever making the host wait for the device.

A check that needs a device tensor's value (is the loss finite? is the AMP scale larger than the clip limit?) hands
a 0-dim tensor, or one of two elements, to `check` with a callback. On the CPU the value is read at once and the
callback runs. On an accelerator the value is copied without blocking into a slot of a small ring of host memory
(pinned, allocated once per device), an event is recorded after the copy on the tensor's current stream, and the
callback runs when `poll` finds that event completed: ST006 polls at each backward it looks at (`schedule`), and what
is still pending is waited for at exit. A slot is never read before its event has completed, so the program's stream
never waits for safetorch; the per-step work is the copy, the event and O(1) Python. When every slot of a device is
still in flight (the device more than `RING` checks behind the host), the value is not checked and `dropped` counts
it: a check that would wait is worse than a check skipped.

What only a device has (pinned memory, events, streams) is an adapter: CUDA's (ROCm included), and `_Fake`, which
makes CPU tensors take the accelerator path, so that CI runs, tests and benches the very lines a GPU run runs
(`force_cpu`, or ``SAFETORCH_DEFERRED_CPU=1`` in the environment, an internal switch for tests and the bench). Its
events complete `lag` recorded events later, as those of a device running behind the host would. Other accelerator
types (MPS, XPU) are not checked on the device: their values are left unread rather than read with a wait.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["EVERY", "FIRST", "RING", "check", "clear", "dropped", "force_cpu", "host_buffers", "pending", "schedule",
           "poll"]

#: Slots per device: checks in flight at once. ST006 queues one per looked-at backward; a device this far behind is
#: rare.
RING = 64
#: On the accelerator path a per-step check looks at the first FIRST steps, then at one in EVERY (`schedule`): a device
#: operation per step would cost a program on the CPU more than the check is worth, and what goes wrong for good (a
#: diverged loss stays NaN) is still found within EVERY steps.
FIRST = 64
EVERY = 32


def schedule() -> Iterator[bool]:
    """Whether each step is looked at, one ``next()`` in C per step (ST006's, asked by `safetorch._backward`)."""
    return itertools.chain(itertools.repeat(True, FIRST), itertools.cycle((False,) * (EVERY - 1) + (True,)))

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
    def record(event: _FakeEvent, value: torch.Tensor) -> None:
        event.record()


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
    """CUDA's adapter: a pinned buffer (a non-blocking copy into pageable memory would block) and CUDA events, each
    recorded on the current stream of the value's device (where torch queued the copy)."""

    @staticmethod
    def buffer(rows: int) -> torch.Tensor:
        return torch.zeros(rows, 2, dtype=torch.float32, pin_memory=True)

    @staticmethod
    def event() -> Any:
        return torch.cuda.Event()

    @staticmethod
    def record(event: Any, value: torch.Tensor) -> None:
        event.record(torch.cuda.current_stream(value.device))


class _Slot:
    __slots__ = ("scalar", "pair", "host", "event", "ready", "payload", "owner", "pairwise", "ring")

    def __init__(self, row: torch.Tensor, event: Any, ring: _Ring) -> None:
        self.scalar, self.pair, self.event, self.ring = row[0], row, event, ring
        self.host: Any = _numpy(row)  # read without a torch call when numpy is there
        self.ready: Ready | None = None
        self.payload: Any = None
        self.owner = ""
        self.pairwise = False

    def read(self) -> Any:
        """The value the device wrote (only once the slot's event has completed)."""
        if self.host is not None:
            return self.host.tolist() if self.pairwise else float(self.host[0])
        return self.pair.tolist() if self.pairwise else self.scalar.item()


def _numpy(row: torch.Tensor) -> Any:
    try:
        return row.numpy()
    except Exception:  # torch without numpy
        return None


class _Ring:
    """One device's slots: the `free` ones (the others are in `_queue`)."""

    __slots__ = ("adapter", "buffer", "free")

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.buffer = adapter.buffer(RING)
        self.free = [_Slot(self.buffer[i], adapter.event(), self) for i in range(RING)]


#: Rings by device: a CUDA device's index, and -1 for the CPU taking the accelerator path.
_rings: dict[int, _Ring] = {}
#: The slots in flight, in the order their events were recorded (each device's in its own order).
_queue: deque[_Slot] = deque()
_lock = threading.Lock()
#: Whether a slot is in flight: what every poll site reads first.
pending = False
dropped = 0
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


def is_deferred(t: torch.Tensor) -> bool:
    """Whether a check of ``t``'s value takes the accelerator path (a CUDA tensor, or any with `force_cpu` on)."""
    return not t.is_cpu or FORCED


def _ring(value: torch.Tensor) -> _Ring | None:
    if value.is_cuda:
        key, adapter = value.get_device(), _Cuda
    elif FORCED and value.is_cpu:
        key, adapter = -1, _Fake
    else:
        return None  # other accelerators: not read at all rather than read with a wait
    ring = _rings.get(key)
    if ring is None:
        ring = _rings[key] = _Ring(adapter)
    return ring


def check(value: torch.Tensor, ready: Ready, payload: Any, owner: str) -> bool:
    """Call ``ready(v, payload)`` with ``value``'s content (a float for a 0-dim tensor, two floats for a pair): now
    on the CPU, once the device has computed it on an accelerator. ``value`` may require grad (it is copied without
    recording a graph). False when it could not be queued (a device type without an adapter, or every slot in
    flight)."""
    global pending, dropped
    if value.is_cpu and not FORCED:
        ready(value.tolist(), payload)
        return True
    ring = _ring(value)
    if ring is None:
        return False
    free = ring.free
    if not free:
        poll()
        if not free:
            dropped += 1
            return False
    with _lock:
        if not free:  # another thread took the last one
            dropped += 1
            return False
        slot = free.pop()
        slot.ready, slot.payload, slot.owner, slot.pairwise = ready, payload, owner, value.dim() > 0
        grad = _grad_enabled()
        if grad:
            _set_grad_enabled(False)  # detach() would cost a torch call more
        try:
            (slot.pair if slot.pairwise else slot.scalar).copy_(value, non_blocking=True)
        finally:
            if grad:
                _set_grad_enabled(True)
        ring.adapter.record(slot.event, value)
        _queue.append(slot)
        pending = True
    return True


def poll(wait: bool = False) -> None:
    """Run the callbacks of the checks whose value the device has computed (of all of them, waiting, when ``wait``:
    at exit). A slot is read only once its event has completed; one stream completes in order, so the first slot
    not completed ends the look (a later device's slots wait behind it: later, not wrong)."""
    global pending
    done = []
    with _lock:
        while _queue:
            slot = _queue[0]
            if wait:
                slot.event.synchronize()
            elif not slot.event.query():
                break
            _queue.popleft()
            if slot.ready is not None:
                done.append((slot.ready, slot.read(), slot.payload))
            slot.ready = slot.payload = None
            slot.ring.free.append(slot)
        pending = bool(_queue)
    if done:
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
        for slot in _queue:
            if owner is None or slot.owner == owner:
                slot.ready = slot.payload = None


def force_cpu(on: bool, lag: int = 1) -> None:
    """Make CPU tensors take the accelerator path (tests, the bench), with a fake device `lag` events behind."""
    global FORCED, pending
    from . import _backward

    with _lock:
        FORCED = on
        _backward.restart_schedule()
        _Fake.lag, _Fake.recorded, _Fake.done = lag, 0, 0
        fake = _rings.pop(-1, None)
        if fake is not None:
            _queue.extend(s for s in [_queue.popleft() for _ in range(len(_queue))] if s.ring is not fake)
        pending = bool(_queue)


def host_buffers() -> list[torch.Tensor]:
    """The host memory the rings read (for the tests that fail on any read of a device tensor)."""
    return [ring.buffer for ring in _rings.values()]


def _after_fork_in_child() -> None:
    """A forked child has no device context of its own (CUDA cannot be used in it): its parent's slots are the
    parent's to read."""
    global pending, _lock
    _lock = threading.Lock()  # the parent may have held it while forking
    _rings.clear()
    _queue.clear()
    pending = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
