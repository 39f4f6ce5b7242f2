"""The methods a program throws away, read from its code as the code is loaded (Python 3.10 and 3.11).

Design rules: where ``sys.monitoring`` is missing (`safetorch._monitor` needs 3.12), a check about a statement alone
(``x.view(2, 8)`` as a statement does nothing) can see a call only by patching the method, and a patched method costs
every call a Python frame (about 3k instructions): a model's forward makes hundreds of ``view``/``transpose`` calls
a step, and torch's ``clip_grad_norm_`` one ``.to()`` per parameter, none of which is ever a finding. So a method is
patched only once the program's code holds a statement that throws its result away; until then it stays torch's own.

The program's code is read, once per code object and with the code objects nested in it (a module's holds its
functions'), before it runs:

- at `start`: the code running now (the module that imports safetorch, with every function it defines), the modules
  of the program already imported, and the script ``sys.argv[0]`` names when none of its code runs yet (a
  ``sitecustomize`` installs before the script starts);
- then: every module imported, and what ``runpy`` (``python -m``, spawned workers), IPython (a notebook's cells),
  pytest's assertion rewriter and ``zipimport`` execute: the name ``exec`` in those modules' globals is a function of
  ours that reads the code object and calls the builtin, taking its own frame out of whatever the code raises;
- and every frame the call-site reader meets on a slow path (`safetorch._callsite.meet`).

A code object's *sites* are its calls whose result the bytecode pops (`safetorch._callsite.discards`); the callee of
each is the instruction that pushed it (``LOAD_METHOD view``). A site whose callee is named and is a watched method
asks for that method; one whose callee is another method or a variable (``print``, ``optimizer.step``, a closure's
``criterion``) asks for nothing, or for the watched methods the code stores in that variable (``f = x.cpu; f()``); one
whose callee cannot be told (a call's result, an item, arguments that hold a jump) asks for every watched method the
code mentions, and for all of them where the code calls ``getattr`` (``getattr(x, name)()``); any other callee (a
constant, as a ``with`` block's ``__exit__`` reads) asks for nothing.

Library code (installed packages, the standard library) and torch's, wrapt's and safetorch's own are not read: on
these Pythons what the program cannot change is not looked at (on 3.12+ it is). Code the program builds and runs with
its own ``exec`` is read only where the call-site reader meets it.
"""

from __future__ import annotations

import builtins
import dis
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

from . import _callsite
from ._callsite import CALLS, callee_index, discards, instructions
from ._report import internal_error, is_internal, is_library, is_library_file
from ._tracebacks import hide_own_frames

AVAILABLE = sys.version_info < (3, 12)

#: ``on_found(names)``: the watched methods whose result a statement of the program throws away, first found now.
Found = Callable[[frozenset[str]], None]

#: Instructions that push a callee known by its name.
_NAMED = frozenset({"LOAD_METHOD", "LOAD_ATTR", "LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTES = frozenset({"LOAD_METHOD", "LOAD_ATTR"})
_VARIABLES = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLASSDEREF"})
_STORES = frozenset({"STORE_FAST", "STORE_DEREF", "STORE_NAME", "STORE_GLOBAL"})
#: Callees that may be any method: a call's result (``getattr(x, "cpu")()``), an item (``fns[0]()``).
_UNTOLD = CALLS | {"PRECALL", "BINARY_SUBSCR"}
#: The modules whose ``exec`` runs the program's code: importlib's loaders, runpy, IPython, pytest, zipimport.
_EXECUTORS = ("_frozen_importlib_external", "runpy", "IPython.core.interactiveshell", "_pytest.assertion.rewrite",
              "zipimport")
_READER = "core:discards"
_MAX_READ = 1 << 16
_exec = builtins.exec


class _State:
    """The one owner of the watch's state."""

    def __init__(self) -> None:
        self.code = ""  # the rule whose watch this is (internal errors are reported under it)
        self.names: frozenset[str] = frozenset()
        self.on_found: Found | None = None
        #: the watched names found at a site so far (kept across `stop`/`start`: the code that holds them still does)
        self.found: set[str] = set()
        #: id(code) -> weak reference: the code objects read
        self.read: dict[int, weakref.ref[CodeType]] = {}
        #: id(module) -> (a weak reference to it, the size of its namespace): the imported modules walked at a `start`
        self.modules: dict[int, tuple[weakref.ref[types.ModuleType], int]] = {}
        #: the modules whose ``exec`` is ours: module -> what stood there before (None: the builtin)
        self.shadowed: dict[types.ModuleType, Any] = {}
        self.lock = threading.RLock()


_state = _State()


def watching() -> bool:
    return _state.on_found is not None


def found() -> frozenset[str]:
    return frozenset(_state.found)


def _bound_to(ins: list[dis.Instruction], name: str, names: frozenset[str]) -> set[str]:
    """The watched methods the code stores in the variable ``name`` (``f = x.cpu``)."""
    return {ins[i - 1].argval for i in range(1, len(ins))
            if ins[i].opname in _STORES and ins[i].argval == name and ins[i - 1].opname in _NAMED
            and ins[i - 1].argval in names}


def discarded_names(code: CodeType, names: frozenset[str]) -> set[str]:
    """The names of ``names`` that a call of ``code`` (not of the code nested in it) may throw the result of away."""
    mentioned = names.intersection(code.co_names)
    if not mentioned and "getattr" not in code.co_names:
        return set()
    ins = instructions(code)
    asked: set[str] = set()
    for i, call in enumerate(ins):
        # Not cached: a call site whose answer is cached meets no reader when it first runs (ST021's reading).
        if call.opname not in CALLS or not discards(code, call.offset, cache=False):
            continue
        j = callee_index(ins, i)
        callee = ins[j] if j is not None else None
        if callee is not None and callee.opname in _NAMED and callee.argval in names:
            asked.add(callee.argval)
            continue
        if callee is not None and callee.opname in _ATTRIBUTES:
            continue  # another method
        if callee is not None and callee.opname in _VARIABLES:
            asked |= _bound_to(ins, callee.argval, names)  # ``f = x.cpu; f()``; else a function the program holds
            continue
        if callee is not None and callee.opname not in _UNTOLD:
            continue  # a constant (a ``with`` block's ``__exit__``, read as the None it is called with), ...
        if "getattr" in code.co_names:  # ``getattr(x, name)()``: any of them
            return set(names)
        asked |= mentioned | names.intersection(c for c in code.co_consts if isinstance(c, str))
    return asked


def read(code: CodeType) -> None:
    """Read ``code`` and the code objects nested in it (each once); ask for the methods their sites call."""
    if _state.on_found is None:
        return
    asked: set[str] = set()
    with _state.lock:
        stack = [code]
        while stack:
            each = stack.pop()
            key = id(each)
            entry = _state.read.get(key)
            if entry is not None and entry() is each:
                continue  # and the code nested in it, read with it
            if len(_state.read) > _MAX_READ:  # bounded: generated code makes code objects without end
                _state.read.clear()
            _state.read[key] = weakref.ref(each)
            if is_internal(each) or is_library(each):
                continue
            asked |= discarded_names(each, _state.names)
            if _meeting and any(meet(each) for meet in list(_meeting.values())):
                asked |= _state.names.intersection(each.co_names)  # its calls of them meet it as it runs
            stack.extend(c for c in each.co_consts if isinstance(c, CodeType))
        new = frozenset(asked - _state.found)
        _state.found |= new
    if new and _state.on_found is not None:
        _state.on_found(new)


def _meet(frame: FrameType) -> None:
    try:
        read(frame.f_code)
    except Exception as exc:
        internal_error(_state.code, exc)


def _executor(previous: Any) -> Callable[..., Any]:
    """The ``exec`` of a module that runs the program's code: read the code object, then run it as the builtin does,
    with no frame of ours in what it raises."""
    run = previous if callable(previous) else _exec

    def exec(source: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001  (it stands for the builtin)
        __tracebackhide__ = True  # noqa: F841
        if isinstance(source, CodeType):
            try:
                read(source)
            except Exception as exc:
                internal_error(_state.code, exc)
        if not args and "globals" not in kwargs:  # the caller's namespace, as the builtin would take it
            caller = sys._getframe(1)
            args = (caller.f_globals, caller.f_locals)
        try:
            return run(source, *args, **kwargs)
        except BaseException as exc:
            hide_own_frames(exc)
            raise
        finally:
            namespace = args[0] if args else kwargs.get("globals")
            if isinstance(namespace, dict) and namespace.get("__name__") in _EXECUTORS:
                _shadow(sys.modules.get(namespace["__name__"]))  # an executor imported now (IPython's shell)

    exec.__safetorch_patch__ = True  # type: ignore[attr-defined]
    return exec


def _shadow(module: types.ModuleType | None) -> None:
    if module is None or module in _state.shadowed or _state.on_found is None:
        return
    namespace = vars(module)
    _state.shadowed[module] = namespace.get("exec")
    namespace["exec"] = _executor(namespace.get("exec"))


def _unshadow() -> None:
    for module, previous in list(_state.shadowed.items()):
        namespace = vars(module)
        if getattr(namespace.get("exec"), "__safetorch_patch__", False):
            if previous is None:
                del namespace["exec"]
            else:
                namespace["exec"] = previous
    _state.shadowed.clear()


def _program_modules() -> Iterator[types.ModuleType]:
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        if isinstance(module, types.ModuleType) and isinstance(filename, str) and filename.endswith(".py") \
                and not is_library_file(filename):
            yield module


def _codes_of(module: types.ModuleType) -> Iterator[CodeType]:
    """The code objects of an imported module's functions and classes' methods (its own code object is gone)."""
    name = module.__name__
    for value in list(vars(module).values()):
        items = list(vars(value).values()) if isinstance(value, type) and value.__module__ == name else [value]
        for item in items:
            item = getattr(item, "__func__", item)  # staticmethod, classmethod
            item = getattr(item, "fget", item)  # property
            code = getattr(item, "__code__", None)
            if isinstance(code, CodeType) and getattr(item, "__module__", None) == name:
                yield code


def _script() -> CodeType | None:
    """The script ``sys.argv[0]`` names, compiled, when none of its code runs yet (a ``sitecustomize`` installs)."""
    main = sys.modules.get("__main__")
    path = sys.argv[0] if sys.argv else ""
    if getattr(main, "__file__", None) or not path.endswith(".py") or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            source = f.read(1 << 22)
        return compile(source, path, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError):
        return None


def start(code: str, names: frozenset[str], on_found: Found) -> bool:
    """Watch the program's code for statements that throw away a call of ``names`` for the rule ``code``;
    ``on_found(names)`` is called with those it finds (at once with those found before). False on 3.12+."""
    if not AVAILABLE:
        return False
    stop()
    _state.code, _state.names, _state.on_found = code, names, on_found
    known = frozenset(_state.found & names)
    if known:
        on_found(known)  # what was read before stays read: its names are asked for again
    try:
        _read_program(sys._getframe(1))
        for name in _EXECUTORS:
            _shadow(sys.modules.get(name))
    except Exception as exc:
        internal_error(code, exc)
    _callsite.on_new_code(_READER, _meet)
    return True


def _read_program(frame: FrameType | None) -> None:
    """What of the program's code exists before it runs: the frames from ``frame`` out (the program's module, the
    function that installed safetorch), the program's modules imported, and the script not running yet."""
    while frame is not None:
        read(frame.f_code)
        frame = frame.f_back
    for module in _program_modules():
        size, walked = len(vars(module)), _state.modules.get(id(module))
        if walked is not None and walked[0]() is module and walked[1] == size:
            continue  # walked at an earlier start, and nothing added to it since
        _state.modules[id(module)] = (weakref.ref(module), size)
        for each in _codes_of(module):
            read(each)
    script = _script()
    if script is not None:
        read(script)


def meet_while_running(name: str, predicate: Callable[[CodeType], bool] | None) -> None:
    """Have the code objects ``predicate`` picks met by the call-site reader while they run, as a check that reads
    whole code objects (ST021, `safetorch._callsite.on_new_code`) needs: on these Pythons the first call at a
    patched method's call site meets its frame, so the watched methods such code calls are patched too. None
    removes it. Only code read from then on is asked (a check registers when its module is imported, before any
    `start`)."""
    if predicate is None:
        _meeting.pop(name, None)
    else:
        _meeting[name] = predicate


#: name -> predicate: the code objects a reader asks to meet while they run (`meet_while_running`)
_meeting: dict[str, Callable[[CodeType], bool]] = {}


def stop() -> None:
    """Stop watching: the ``exec`` of each executor is the builtin again."""
    _callsite.on_new_code(_READER, None)
    _unshadow()
    _state.on_found = None


__all__ = ["AVAILABLE", "discarded_names", "found", "meet_while_running", "read", "start", "stop", "watching"]
