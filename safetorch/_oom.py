"""The out-of-memory note: when ``torch.OutOfMemoryError`` or torch's CPU allocation failure leaves the program, say
what holds the autograd graphs no backward has consumed, which line fills each holder, and what to write instead.

Design rules: computed only then, from what can be found at that moment — the names in the frames of the error's
traceback (the loop that ran out, its callers, the script's globals), and every live tensor that carries a graph
(the garbage collector's list) for the count and the bytes; nothing is recorded per step. On a GPU it also gives
``torch.cuda.memory_allocated()``.
"""

from __future__ import annotations

import mmap
from types import FrameType, TracebackType

import torch

from . import _graphs
from ._callsite import fills, getline
from ._report import is_internal

__all__ = ["is_out_of_memory", "note", "release", "reserve"]

#: Address space set aside at install for writing the note when memory has run out: an anonymous mapping never
#: touched, so it costs no resident memory, only room in the address space that a limit (``RLIMIT_AS``) counts;
#: given back just before the note is made, so that walking the graphs has room to allocate.
_RESERVE = 16 << 20
_reserved: list[mmap.mmap] = []


def reserve() -> None:
    if not _reserved:
        try:
            _reserved.append(mmap.mmap(-1, _RESERVE))
        except (OSError, ValueError):
            pass


def release() -> None:
    while _reserved:
        _reserved.pop().close()

_CPU_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
                 "not enough memory: you tried to allocate")
#: Holders named in the note at most, and graphs walked one by one to tell the consumed from the unconsumed.
_SHOWN = 4
_ROOTS = 4096
_ROOT_NODES = 64


def is_out_of_memory(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _CPU_FAILURES)


def _frames(tb: TracebackType | None) -> list[FrameType]:
    """The user's frames of a traceback, innermost first, then the callers of the outermost."""
    frames: list[FrameType] = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    frames.reverse()
    outer = frames[-1].f_back if frames else None
    while outer is not None:
        frames.append(outer)
        outer = outer.f_back
    return [f for f in frames if not is_internal(f.f_code)]


def _unconsumed(tensors: list[torch.Tensor]) -> tuple[int, _graphs.Account]:
    """How many of ``tensors`` start a graph no other of them is part of and that still holds saved tensors, and
    the account of them all."""
    whole = _graphs.account(tensors)
    roots = {id(t.grad_fn): t for t in tensors if t.grad_fn is not None and id(t.grad_fn) not in whole.children}
    count = 0
    for t in list(roots.values())[:_ROOTS]:
        one = _graphs.account([t], limit=_ROOT_NODES)
        count += bool(one.kept) and not one.released
    return count, whole


def _where(holder: _graphs.Holder, frames: list[FrameType]) -> tuple[str, int, str]:
    """Where the holder is filled (the first line of the frames' code that puts into it), and that statement."""
    for frame in [holder.frame, *frames]:
        line = fills(frame.f_code, holder.name)
        if line is not None:
            break
    else:
        frame, line = holder.frame, holder.frame.f_lineno
    filename = frame.f_code.co_filename
    return filename, line, _graphs.statement_of(getline(filename, line, frame.f_globals), holder.name)


def _fix(holder: _graphs.Holder, statement: str) -> str:
    scalar = all(t.numel() == 1 for t in holder.tensors[:8])
    return _graphs.fixed(statement, ".item()" if scalar else ".detach()")


def note(exc: BaseException) -> str | None:
    """The note for an out-of-memory error, or None for another error (or when nothing keeps a graph)."""
    if not is_out_of_memory(exc):
        return None
    release()
    frames = _frames(exc.__traceback__)
    named = _graphs.holders(frames)
    try:
        everything = _graphs.graph_tensors()
    except MemoryError:  # no room even for the list of every object: the named holders' graphs are counted
        everything = [t for h in named for t in h.tensors]
    graphs, whole = _unconsumed(everything)
    lines = [f"safetorch: memory ran out with {graphs} autograd graph{'s' if graphs != 1 else ''} alive that no "
             f"backward has consumed, holding {_graphs.human(whole.bytes)} of saved tensors."]
    ranked = sorted(((_graphs.account(h.tensors), h) for h in named), key=lambda pair: -pair[0].bytes)
    for acc, holder in ranked[:_SHOWN]:
        if not acc.bytes:
            continue
        filename, lineno, statement = _where(holder, frames)
        lines.append(f"  {holder.describe()}, filled at {filename}:{lineno} (`{statement}`), holds "
                     f"{_graphs.human(acc.bytes)}. Write: {_fix(holder, statement)}")
    lines.append("  Keep numbers (`.item()`) or detached tensors (`.detach()`) of what outlives a step, and run "
                 "evaluations under `with torch.no_grad():`.")
    device = _device()
    if device:
        lines.append(f"  {device}")
    return "\n".join(lines) if graphs or len(lines) > 2 else None


def _device() -> str:
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return f"torch.cuda.memory_allocated() = {_graphs.human(torch.cuda.memory_allocated())}."
    except Exception:
        pass
    return ""
