"""How the runner starts the user's program: as ``python script.py`` or ``python -m module`` would."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from types import TracebackType

_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")


def _hide_runner(tb: TracebackType | None) -> TracebackType | None:
    """The program's traceback without the runner's frames (this module's and runpy's) in front of it."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, _MAIN, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb


def importable(module: str) -> bool:
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def run(module: str | None, args: list[str]) -> int:
    try:
        if module is not None:
            sys.argv = [module, *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # the program's own exception: its traceback starts at its own code
        return _excepthook(exc)
    return 0


def _excepthook(exc: BaseException) -> int:
    """Show the program's exception as Python would have, had it run the program itself; the exit code too."""
    tb = _hide_runner(exc.__traceback__)
    exc.__traceback__ = tb  # the hook prints the exception's own traceback (a script that does not compile: none)
    sys.excepthook(type(exc), exc, tb)
    return 130 if isinstance(exc, KeyboardInterrupt) else 1
