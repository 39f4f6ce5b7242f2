"""ST007: ``torch.cuda.empty_cache()`` called over and over from one line.

Calling it every iteration frees nothing that live tensors hold; it hands cached blocks back to the driver, which
torch must then allocate again (slower), and it hides the real leak. An occasional call (after a phase, before a
big allocation) is legitimate, so the rule counts calls per call site and fires once when one line has called it
`THRESHOLD` times within `WINDOW_S` seconds — a loop, not an epoch boundary.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any

import torch

from .._exceptions import SafetorchError
from .._patch import Registry
from .._report import internal_error, is_internal, report

CODE = "ST007"
THRESHOLD = 10
WINDOW_S = 60.0

_calls: dict[tuple[int, int], deque[float]] = {}
_codes: list[Any] = []
_clock = time.monotonic

MESSAGE = (f"{CODE} torch.cuda.empty_cache() has been called {THRESHOLD} times from this line within "
           f"{WINDOW_S:.0f} s: it frees no memory that live tensors hold, it only returns cached blocks that torch "
           f"must then allocate again (slower), and it hides the real cause. If memory grows, look for what keeps "
           f"tensors alive (a validation loop without torch.no_grad(), total_loss += loss, tensors kept in a list). "
           f"Write: remove the call from the loop")


def _empty_cache(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    __tracebackhide__ = True  # noqa: F841
    try:
        frame = sys._getframe(1)
        code = frame.f_code
        key = (id(code), frame.f_lasti)
        times = _calls.get(key)
        if times is None:
            if is_internal(code) or torch.compiler.is_compiling():
                times = None
            else:
                times = _calls[key] = deque(maxlen=THRESHOLD)
                _codes.append(code)  # keeps the code alive, so that its id is not reused for another
        if times is not None:
            now = _clock()
            times.append(now)
            if len(times) == THRESHOLD and now - times[0] <= WINDOW_S:
                report(CODE, frame, MESSAGE)
    except SafetorchError:
        raise
    except Exception as exc:
        internal_error(CODE, exc)
    return wrapped(*args, **kwargs)


def install(registry: Registry) -> None:
    registry.wrap(torch.cuda, "empty_cache", _empty_cache, CODE)
    registry.wrap(torch.cuda.memory, "empty_cache", _empty_cache, CODE)


def uninstall() -> None:
    _calls.clear()
    _codes.clear()
