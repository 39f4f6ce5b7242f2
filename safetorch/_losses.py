"""The one replacement of ``torch.nn._reduction.get_enum`` that checks share (ST002 converts the legacy
``'elementwise_mean'``, ST009 reads the input of ``cross_entropy``, ``nll_loss`` and
``binary_cross_entropy_with_logits``; ST004 looks at what the program keeps while it computes losses).

Design rules: every functional loss of torch calls ``get_enum(reduction)`` from its own frame, so this single
choke point sees every loss with its arguments one frame up, and no wrapper frame stands between the user and a
functional loss (torch's own warnings keep pointing at the user's line, tracebacks show no safetorch frame). It is
a plain function put in place by `Registry.replace`, as every loss calls it. A loss that a check reads is found by
its code object. The first `FIRST` loss calls are looked at, then one in `EVERY` on average, and of those only
the ones computed with autograd on (there is no graph to read otherwise) — a check sees the mistakes that are in
the code, which every call of its line repeats, and materialising the loss's frame is what costs (14k instructions).
The other calls pay one ``next()`` of a schedule of booleans, a call in C that returns a constant (counting in a
global and testing grad mode first cost every loss 0.8k instructions more). The intervals between looks vary (1 to
``2 * EVERY - 1`` calls, drawn once from a seeded generator of our own, repeated every ~``EVERY ** 2`` calls): with
a fixed period, a loss that is always the first of two per step would never be looked at again after the first ones.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import torch
from torch.nn import _reduction

from ._compat import is_compiling
from ._patch import registry, with_globals_of
from ._tracebacks import hide_own_frames

GROUP = "core:get_enum"

#: ``legacy()``: called for ``reduction='elementwise_mean'``; reports it (raises in strict mode).
Legacy = Callable[[], None]
#: ``look(loss_frame)``: the frame of the functional loss that is calling ``get_enum``, with autograd on.
Look = Callable[[FrameType], None]

_legacy: dict[str, Legacy] = {}
_looks: dict[CodeType, Look] = {}
#: Looks at every loss, whichever function computes it (ST004: what the program keeps while it computes losses).
_every: dict[str, Look] = {}
_owners: dict[str, list[CodeType]] = {}
_is_compiling = is_compiling
_is_grad_enabled = torch.is_grad_enabled

#: The first FIRST loss calls are looked at, then one in EVERY on average.
FIRST = 32
EVERY = 64
_next = next


def _schedule() -> Iterator[bool]:
    """True for each loss call to look at: FIRST times, then a cycle of random intervals of mean EVERY."""
    draw, pattern = random.Random(0), []
    while len(pattern) < EVERY * EVERY:
        pattern += [False] * (draw.randrange(1, 2 * EVERY) - 1) + [True]
    # Not itertools.cycle: its first pass copies every item it returns, 1k instructions a call.
    again = itertools.chain.from_iterable(itertools.repeat(tuple(pattern)))
    return itertools.chain(itertools.repeat(True, FIRST), again)


#: The schedule in use, in a box that `reset` refills: the replacement holds the box, not this module.
_looking = [_schedule()]


def _dispatch(original: Any) -> Any:
    """A plain function, not a wrapt proxy (see `Registry.replace`): every loss computation calls it. TorchScript,
    compiling a scripted forward that calls a loss, reads torch's ``get_enum`` (``__wrapped__``) and resolves its
    names in the replacement's globals: the replacement has torch's module's globals (`with_globals_of`) and reaches
    everything of its own through its closure (``warnings``, which torch's function uses, is in safetorch's module
    only by accident on some Pythons)."""

    # torch's own answers for the three valid names, asked once: a dict lookup costs less than calling torch's
    # function; anything else ('elementwise_mean', a typo) still goes to torch, for its warning or its error.
    known = {name: original(name) for name in ("none", "mean", "sum")}
    legacies, looks, every, looking, getframe = _legacy, _looks, _every, _looking, sys._getframe
    following, grad_enabled, compiling, hide = _next, _is_grad_enabled, _is_compiling, hide_own_frames

    def get_enum(reduction: str) -> int:
        __tracebackhide__ = True  # noqa: F841
        try:
            if following(looking[0]) and (looks or every) and grad_enabled() and not compiling():
                caller = getframe(1)
                look = looks.get(caller.f_code)
                if look is not None:
                    look(caller)
                for look in list(every.values()):
                    look(caller)
            try:
                return known[reduction]  # one look-up for the three valid names (a test first was two)
            except (KeyError, TypeError):  # torch's answer for anything else, an unhashable value's error included
                pass
            if reduction == "elementwise_mean" and legacies:
                for legacy in list(legacies.values()):
                    legacy()
                return known["mean"]
            return original(reduction)  # type: ignore[no-any-return]
        except BaseException as exc:  # no frame of ours in the traceback of what passes through
            hide(exc)
            raise

    return with_globals_of(original, get_enum)


def reset() -> None:
    """Start counting losses again, as a new process does (for the tests)."""
    _looking[0] = _schedule()


def _update() -> None:
    if _legacy or _looks or _every:
        registry.replace(_reduction, "get_enum", _dispatch, GROUP)
    else:
        registry.restore(GROUP)


def listen(code: str, legacy: Legacy | None = None, looks: dict[CodeType, Look] | None = None,
           every: Look | None = None) -> None:
    if legacy is not None:
        _legacy[code] = legacy
    if every is not None:
        _every[code] = every
    for loss_code, look in (looks or {}).items():
        _looks[loss_code] = look
        _owners.setdefault(code, []).append(loss_code)
    _update()


def unlisten(code: str) -> None:
    _legacy.pop(code, None)
    _every.pop(code, None)
    for loss_code in _owners.pop(code, []):
        _looks.pop(loss_code, None)
    _update()
