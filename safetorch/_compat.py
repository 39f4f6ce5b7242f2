"""The few torch APIs that are newer than the oldest torch safetorch allows, with their fallbacks.

``pyproject.toml`` says ``torch>=2.1``: every torch API the checks use exists in 2.1 except those below, which are
looked up here once, with what older releases call them. The test suite runs on torch 2.13 only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _never() -> bool:
    return False


def _is_compiling() -> Callable[[], bool]:
    compiler = getattr(torch, "compiler", None)
    found = getattr(compiler, "is_compiling", None)  # torch >= 2.3
    if found is None:
        dynamo = getattr(torch, "_dynamo", None)  # torch 2.1 / 2.2
        found = getattr(dynamo, "is_compiling", None)
    return found or _never


#: ``torch.compiler.is_compiling`` where it exists (2.3+), else ``torch._dynamo.is_compiling``.
is_compiling: Callable[[], bool] = _is_compiling()


class _NoFlag:
    _is_compiling_flag = False


#: For the paths every step takes, ``dynamo_compiling() or compile_flags._is_compiling_flag`` answers as
#: `is_compiling` does at a third of its cost (one Python call instead of two, measured: 380 instructions against
#: 1,070): dynamo answers ``torch.compiler.is_dynamo_compiling()`` as True and never reads the flag (a flag read
#: alone would be guarded: a recompile at every call), and the flag is True while ``torch.export`` traces without
#: dynamo. Where ``is_dynamo_compiling`` is missing (torch < 2.3) it is `is_compiling`.
dynamo_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", None) or \
    is_compiling
compile_flags: Any = getattr(torch, "compiler", None) if hasattr(getattr(torch, "compiler", None),
                                                                  "_is_compiling_flag") else _NoFlag()


_FAKE = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
_get_dispatch_mode = getattr(torch._C, "_get_dispatch_mode", None)


def fake_mode_active() -> bool:
    """True inside ``FakeTensorMode`` (tracing with tensors that have no data): a check that reads a value fails
    there, where torch itself is fine."""
    return _FAKE is not None and _get_dispatch_mode is not None and _get_dispatch_mode(_FAKE) is not None
