"""ST007: ``torch.cuda.empty_cache()`` called over and over from one line.

Calling it every iteration frees nothing that live tensors hold; it hands cached blocks back to the driver, which
torch must then allocate again (slower), and it hides the real leak. An occasional call (after a phase, before a
big allocation) is legitimate, so the rule counts calls per call site and fires once when one line has called it
`THRESHOLD` times within `WINDOW_S` seconds (counted in windows of `THRESHOLD` calls) — a loop, not an epoch
boundary.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

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

# Per call site: [calls in the current window, the window's start, the code object (kept alive, so that its id is
# not reused)]. Keyed by id(code) + offset: the offset lies inside the code object, so two live code objects never
# share a key (and the entry's code is checked anyway).
_calls: dict[int, list[Any]] = {}
_clock = time.monotonic

MESSAGE = (f"{CODE} torch.cuda.empty_cache() has been called {THRESHOLD} times from this line within "
           f"{WINDOW_S:.0f} s: it frees no memory that live tensors hold, it only returns cached blocks that torch "
           f"must then allocate again (slower), and it hides the real cause. If memory grows, look for what keeps "
           f"tensors alive (a validation loop without torch.no_grad(), total_loss += loss, tensors kept in a list). "
           f"Write: remove the call from the loop")


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
        code = frame.f_code
        state = _calls.get(id(code) + frame.f_lasti)
        if state is None or state[2] is not code:
            state = _new_site(frame)
        if state is not None:
            state[0] += 1
            if state[0] >= THRESHOLD:  # the clock is read only at a window's start and end
                now = _clock()
                if now - state[1] <= WINDOW_S:
                    report(CODE, frame, MESSAGE)
                state[0], state[1] = 0, now
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


_getframe = sys._getframe


def _new_site(frame: Any) -> list[Any] | None:
    code = frame.f_code
    if is_internal(code) or is_compiling():
        return None
    state = _calls[id(code) + frame.f_lasti] = [0, _clock(), code]
    return state


def install(registry: Registry) -> None:
    registry.replace(torch.cuda, "empty_cache", _empty_cache, CODE)
    registry.replace(torch.cuda.memory, "empty_cache", _empty_cache, CODE)


def uninstall() -> None:
    _calls.clear()
