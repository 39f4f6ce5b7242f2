"""Jupyter and IPython: findings name the cell as IPython does, and uncaught errors get the excepthook's treatment.

Design rules:
- IPython compiles each cell into a temporary file (``/tmp/ipykernel_<pid>/<hash>.py``) and keeps the map from that
  file to the cell's execution count; its tracebacks say ``Cell In[5], line 2``. A finding in a cell is reported
  under the name ``Cell In[5]`` (the cell's lines are registered in `linecache` under that name, so the warning
  still shows the source line), in the warning, the summary and the JSON report alike.
- IPython does not call ``sys.excepthook``: a custom exception handler, installed only when the shell has none, gives
  an uncaught error the same treatment (a strict-mode finding's traceback ends on the cell's line; crash notes).
- Nothing here imports IPython: it is used only when the program already runs inside it.
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["cell_name", "install_handler", "uninstall_handler"]

Annotate = Callable[[BaseException, TracebackType | None], TracebackType | None]
_handler_shell: Any = None


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    return get() if get is not None else None


def cell_name(filename: str) -> str | None:
    """``Cell In[5]`` for the file of a cell run by IPython, else None."""
    try:
        shell = _shell()
        count = shell.compile._filename_map.get(filename) if shell is not None else None
    except Exception:
        return None
    if count is None:
        return None
    name = f"Cell In[{count}]"
    if name not in linecache.cache:
        lines = linecache.getlines(filename)
        if lines:
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    return name


def install_handler(annotate: Annotate) -> None:
    """Inside IPython, route uncaught exceptions through ``annotate`` (unless the shell has a handler already)."""
    global _handler_shell
    try:
        shell = _shell()
        if shell is None or shell.custom_exceptions or _handler_shell is shell:
            return

        def handler(self: Any, etype: type[BaseException], value: BaseException, tb: TracebackType | None,
                    tb_offset: int | None = None) -> None:
            try:
                tb = annotate(value, tb)
            except Exception:
                pass
            self.showtraceback((etype, value, tb), tb_offset=tb_offset)

        shell.set_custom_exc((Exception,), handler)
        _handler_shell = shell
    except Exception:
        pass


def uninstall_handler() -> None:
    global _handler_shell
    try:
        if _handler_shell is not None:
            _handler_shell.set_custom_exc((), None)
    except Exception:
        pass
    _handler_shell = None
