"""How the runner starts the user's program: as ``python script.py`` or ``python -m module`` would.

The program must not be able to tell it was started by the runner. Python runs a script in the ``__main__`` module
that ``sys.modules`` holds for the whole life of the process; pickle looks classes and functions up there by name,
multiprocessing's spawn workers rebuild it from its ``__file__`` or ``__spec__``, and ``atexit`` handlers still find
it after the program returns. ``runpy.run_path`` gives none of this: it runs the code in a temporary module that is
put back after the run, with ``__file__`` as given (relative), which ``os.chdir(os.path.dirname(__file__))`` and
every path python would print (warnings, tracebacks) see. So the runner makes a fresh ``__main__`` as the
interpreter does at start-up, puts it in ``sys.modules`` for good, and fills it the way CPython's own start-up code
does (``pymain_run_python`` in Modules/main.c, ``_PyRun_SimpleFileObject`` in Python/pythonrun.c): for a script,
its absolute path (the current directory joined to it, unnormalized, as ``_Py_abspath`` builds it), the directory
of its real path as ``sys.path[0]``; for ``-m`` and for a directory or zip file, the very function python itself
calls, ``runpy._run_module_as_main``, over that fresh ``__main__``.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import marshal
import os
import pkgutil
import runpy
import sys
from types import CodeType, ModuleType, TracebackType

from . import _discards

_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")

# The runner's own ``__main__`` (safetorch/__main__.py, or the console script), out of sys.modules once the program's
# takes its place: the frames that called the runner still run in its globals.
_runner_main: ModuleType | None = None


def _hide_runner(tb: TracebackType | None) -> TracebackType | None:
    """The program's traceback without the runner's frames (this module's and runpy's) in front of it."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (_HERE, __file__, _MAIN, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb


def importable(module: str) -> bool:
    """Whether ``python -m module`` would find the module (from the current directory, as ``-m`` looks first)."""
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def run(module: str | None, args: list[str]) -> int:
    """Run the program in a fresh ``__main__``; its exit code (``SystemExit`` passes through, as python's own)."""
    _enter_main()
    try:
        if module is not None:
            _run_module(module, args)
        else:
            _run_script(args)
    except SystemExit:
        raise
    except BaseException as exc:  # the program's own exception: its traceback starts at its own code
        return _excepthook(exc)
    return 0


def _enter_main() -> ModuleType:
    """A ``__main__`` as the interpreter makes it at start-up (``add_main_module`` in Python/pylifecycle.c), in
    ``sys.modules`` from now on, in place of the runner's own: the program runs in its ``__dict__``."""
    global _runner_main
    _runner_main = sys.modules.get("__main__")
    main = ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter)
    if sys.version_info < (3, 14):
        # Before PEP 649 python starts ``__main__`` with an empty ``__annotations__``; from 3.14 it adds none (the
        # module's code sets ``__annotate__``, and ``__annotations__`` is computed from it: one put here would hide
        # the program's annotations).
        main.__annotations__ = {}
    sys.modules["__main__"] = main
    # multiprocessing, imported with torch before this, aliased the runner's __main__ as __mp_main__ (the name a
    # spawn worker's __main__ has, under which pickle sends back the classes it defines): alias the program's.
    if _runner_main is not None and sys.modules.get("__mp_main__") is _runner_main:
        sys.modules["__mp_main__"] = main
    return main


def _set_path0(entry: str | None, always: bool = False) -> None:
    """Put the program's ``sys.path[0]`` where python computed the runner's: the runner's own entry (the current
    directory for ``python -m safetorch``, the console script's directory) goes, as a plain run never has it. Under
    ``-P`` (``sys.flags.safe_path``) python adds none, except a directory or zip file's own path (``always``)."""
    safe = getattr(sys.flags, "safe_path", False)
    if not safe and sys.path:
        del sys.path[0]
    if entry is not None and (always or not safe):
        sys.path.insert(0, entry)


def _run_module(module: str, args: list[str]) -> None:
    """``python -m module``: ``sys.argv[0]`` is ``"-m"`` while the module is found, then its file; ``sys.path[0]`` is
    the current directory; ``__spec__`` is the module's spec."""
    sys.argv = ["-m", *args]
    _set_path0(os.getcwd())
    runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]  # what python -m calls


def _run_script(args: list[str]) -> None:
    """``python script.py``: ``sys.argv[0]`` is the path as given, ``__file__`` and every file name python prints
    are the absolute path, ``sys.path[0]`` is the directory of the script's real path. A directory or zip file runs
    its ``__main__`` module, found through ``sys.path[0]``, as python does."""
    sys.argv = list(args)
    given = args[0]
    path = given if os.path.isabs(given) else os.getcwd() + os.sep + given
    if pkgutil.get_importer(path) is not None:  # a directory or a zip file
        _set_path0(path, always=True)
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    _set_path0(os.path.dirname(os.path.realpath(given)))
    code, loader = _compile(path)
    main = sys.modules["__main__"].__dict__
    main.update(__file__=path, __cached__=None, __loader__=loader)
    _discards.read(code)  # 3.10, 3.11: what the script throws away, before it runs (`safetorch._discards`)
    exec(code, main)


def _compile(path: str) -> tuple[CodeType, importlib.machinery.SourceFileLoader
                                 | importlib.machinery.SourcelessFileLoader]:
    """The script's code and the loader python names for it: a compiled file (``.pyc``, or starting with the magic
    number) runs as it is; source compiles under its absolute path, with none of this module's ``__future__``
    flags (``dont_inherit``)."""
    with open(path, "rb") as fh:
        data = fh.read()
    if path.endswith(".pyc") or data[:2] == importlib.util.MAGIC_NUMBER[:2]:
        if data[:4] != importlib.util.MAGIC_NUMBER:
            raise RuntimeError("Bad magic number in .pyc file")
        return marshal.loads(data[16:]), importlib.machinery.SourcelessFileLoader("__main__", path)
    return compile(data, path, "exec", dont_inherit=True), importlib.machinery.SourceFileLoader("__main__", path)


def _excepthook(exc: BaseException) -> int:
    """Show the program's exception as Python would have, had it run the program itself (``sys.last_*`` included,
    for a post-mortem ``pdb.pm()`` in an ``atexit`` handler); the exit code too."""
    tb = _hide_runner(exc.__traceback__)
    exc.__traceback__ = tb  # the hook prints the exception's own traceback (a script that does not compile: none)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    sys.excepthook(type(exc), exc, tb)
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


# The file name this module's code objects carry, which is what a traceback shows (``__file__`` may differ when the
# bytecode was compiled elsewhere).
_HERE = _hide_runner.__code__.co_filename
