"""ST007: ``torch.cuda.empty_cache()`` called over and over from one line.

Calling it every iteration frees nothing that live tensors hold; it hands cached blocks back to the driver, which
torch must then allocate again (slower), and it hides the real leak. An occasional call (after loading a model, after
an epoch or an evaluation, before a big allocation) is legitimate, so the rule counts calls per call site, in *runs*:
consecutive calls from one line with at most `STEP_BACKWARDS` backward() calls between any two of them. A run of
`THRESHOLD` calls is reported once when it is a training loop's (every two consecutive calls have a backward() between
them: one call per training step, however slow the step) or when it took at most `WINDOW_S` seconds (a loop without
backward, such as an evaluation loop, told from a phase boundary by its pace). A call once per epoch (of more than
`STEP_BACKWARDS` batches) starts a new run each time, however fast the epochs.

Cost: the backwards are counted by a listener on the one backward patch (`safetorch._backward`), put in place by a
call of empty_cache() and taken away by the backward that ends every run (`STEP_BACKWARDS` + 1 backwards after the
latest call). A program that never calls empty_cache() pays nothing per step; one that calls it once per epoch pays a
listener call on a few backwards after each call. The clock is read only at a run's start and at its `THRESHOLD`-th
call.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from .. import _backward
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, is_internal, report
from .._rule import Rule

CODE = "ST007"


class EmptyCacheLoopWarning(SafetorchWarning):
    """ST007: ``torch.cuda.empty_cache()`` called over and over from one line."""

    code = "ST007"


RULE = Rule("ST007", "empty-cache-loop", EmptyCacheLoopWarning,
            "torch.cuda.empty_cache() called over and over from one line")
THRESHOLD = 10
WINDOW_S = 60.0
#: Two calls from one line at most this many backward() calls apart are one run: once per training step, gradient
#: accumulation over up to this many micro-batches included. A call once per epoch of more batches starts a new run.
STEP_BACKWARDS = 8

_clock = time.monotonic
_getframe = sys._getframe

# A site's entry: [calls in its run, the run's start (clock), the code object (kept alive, so that its id is not
# reused), the backwards counted at its latest call, the gaps between the run's calls that had a backward in them].
_CALLS, _START, _CODE, _AT, _STEPPED = range(5)


class _State:
    """All of ST007's state, cleared by `uninstall`."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        #: Per call site, keyed by id(code) + offset: the offset lies inside the code object, so two live code
        #: objects never share a key (and the entry's code is checked anyway).
        self.sites: dict[int, list[Any]] = {}
        self.backwards = 0  # the backwards counted while the listener stands (it stops between runs)
        self.last = 0  # `backwards` at the latest call of any site
        self.listening = False


_state = _State()

_WHY = (": it frees no memory that live tensors hold, it only returns cached blocks that torch must then allocate "
        "again (slower), and it hides the real cause. If memory grows, look for what keeps tensors alive (a "
        "validation loop without torch.no_grad(), total_loss += loss, tensors kept in a list). Write: remove the "
        "call from the loop")
MESSAGE = (f"{CODE} torch.cuda.empty_cache() has been called {THRESHOLD} times from this line within "
           f"{WINDOW_S:.0f} s{_WHY}")
STEP_MESSAGE = (f"{CODE} torch.cuda.empty_cache() has been called from this line at every training step, {THRESHOLD} "
                f"steps in a row{_WHY}")


def _empty_cache(original: Any) -> Any:
    """``torch.cuda.empty_cache``: a plain function (see `Registry.replace`) that counts its call site's calls."""

    def empty_cache(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        _count(_getframe(1))
        return original(*args, **kwargs)

    return empty_cache


def _count(frame: Any) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        state = _state
        code = frame.f_code
        site = state.sites.get(id(code) + frame.f_lasti)
        if site is None or site[_CODE] is not code:
            site = _new_site(frame)
            if site is None:
                return
        gap = state.backwards - site[_AT]
        site[_AT] = state.last = state.backwards
        if not state.listening:
            state.listening = True
            _backward.listen(CODE, before=_on_backward)
        if site[_CALLS] == 0 or gap > STEP_BACKWARDS:
            _start_run(site, _clock())
            return
        site[_CALLS] += 1
        site[_STEPPED] += gap > 0
        if site[_CALLS] >= THRESHOLD:
            now = _clock()
            stepped, fast = site[_STEPPED] == THRESHOLD - 1, now - site[_START] <= WINDOW_S
            _start_run(site, now)  # the next run starts here: counted in runs of THRESHOLD calls
            if stepped:
                report(CODE, frame, STEP_MESSAGE)
            elif fast:
                report(CODE, frame, MESSAGE)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _start_run(site: list[Any], now: float) -> None:
    site[_CALLS], site[_START], site[_STEPPED] = 1, now, 0


def _new_site(frame: Any) -> list[Any] | None:
    code = frame.f_code
    if is_internal(code) or is_compiling():
        return None
    site = _state.sites[id(code) + frame.f_lasti] = [0, 0.0, code, _state.backwards, 0]
    return site


def _on_backward(tensors: Any) -> None:
    """A backward listener while a run may go on: counts the backwards; leaves once every run has ended."""
    try:
        state = _state
        state.backwards += 1
        if state.backwards - state.last > STEP_BACKWARDS:
            state.listening = False
            _backward.unlisten(CODE)  # the backward iterates over a tuple of listeners: leaving it now is safe
    except Exception as exc:
        internal_error(CODE, exc)


def install(registry: Registry) -> None:
    registry.replace(torch.cuda, "empty_cache", _empty_cache, CODE)
    registry.replace(torch.cuda.memory, "empty_cache", _empty_cache, CODE)


def uninstall() -> None:
    _backward.unlisten(CODE)
    _state.clear()
