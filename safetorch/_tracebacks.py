"""No safetorch frame in the program's tracebacks.

An exception that passes through a patch — the program's own error raised in the forward of an eval-mode model,
torch's error in a patched method, a strict-mode finding — would show the patch's frames between the program's.
A patch that catches it takes safetorch's frames out of ``__traceback__`` (`hide_own_frames`: ``tb_next`` surgery,
as torch's and typeguard's wrappers do) and re-raises it with a bare ``raise``, which from Python 3.11 adds no frame
of its own: the traceback reads as if torch's function had been called directly. On 3.10 a bare ``raise`` takes the
traceback the exception was caught with, and the patch's frame stays in ``__traceback__``; the excepthook
(`safetorch._install`) takes it out of what it prints for an uncaught error (`without_own_frames`).
"""

from __future__ import annotations

import os
from types import TracebackType

__all__ = ["hide_own_frames", "is_own", "without_own_frames"]



def _directory() -> str:
    """safetorch's directory as its code objects name it (they may have been compiled elsewhere than ``__file__``)."""
    return os.path.dirname(_directory.__code__.co_filename) + os.sep


_OWN = _directory()


def is_own(tb: TracebackType) -> bool:
    """Whether a traceback entry is a frame of safetorch's."""
    return tb.tb_frame.f_code.co_filename.startswith(_OWN)


def hide_own_frames(exc: BaseException) -> BaseException:
    """``exc`` with every safetorch frame taken out of its traceback (the others keep their order); returns it."""
    exc.__traceback__ = without_own_frames(exc.__traceback__)
    return exc


def without_own_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback ``tb`` with every safetorch entry taken out (``tb_next`` relinked): its new head."""
    head = tb
    while head is not None and is_own(head):
        head = head.tb_next
    node = head
    while node is not None:
        following = node.tb_next
        while following is not None and is_own(following):
            following = following.tb_next
        if node.tb_next is not following:
            node.tb_next = following
        node = following
    return head
