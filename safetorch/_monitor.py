"""Calls whose result is thrown away, found in the bytecode and watched with ``sys.monitoring`` (Python 3.12+).

Design rules: a check that is about a statement alone (``x.view(2, 8)`` as a statement does nothing) needs to see
only the calls whose result the bytecode pops, not every call of the method: a model's forward makes hundreds of
``view``/``transpose`` calls per step, each of which a patched method would pay for (a frame and a look at the call
site, about 3k instructions). Here the method stays torch's own, and:

- each code object, the first time it starts (a ``PY_START`` event that then disables itself for that code object,
  so that a code object costs one callback in the life of the process), is read once when its names include a
  watched method or ``getattr`` (``getattr(x, "cpu")()``): its calls whose result is thrown away, as the call-site
  reader tells it, are its *sites*;
- a code object with sites gets ``CALL`` events of its own (``set_local_events``): a call at an instruction that is no
  site disables its event at once, a call at a site whose callee is no watched method and bears none of their names
  too (``losses.append(x)``), so that only the discarded calls of a watched method keep calling back;
- at a site whose callee is the watched method, the handler gets the user's frame (the frame executing the call),
  the method's name and the receiver: before the call runs, or, for the methods watched *after* (`start`'s
  ``after``), once the call has returned (a ``C_RETURN`` event, at that site only), with whether it returned its
  receiver. The result itself is out of reach there; the receiver's reference count tells it: a call that returns its
  receiver adds the one reference the interpreter holds until it pops the result, a copy adds none. Where a copy adds
  one too (a leaf that requires grad: the copy's graph holds it), the method and the receiver tell it.

The code objects already running when the watch starts (the program's module, the function that imported safetorch)
are read then: instrumenting a code object reaches its running frames too. What was read is kept across
`stop`/`start` (an uninstall and an install): a code object whose ``PY_START`` was disabled never reports its start
again. Only code that is not torch's, wrapt's or safetorch's is read.

One tool id of ``sys.monitoring`` is taken (4, else 3: neither is one of CPython's named ids, which debuggers,
coverage and profilers use); none free, `start` answers False and the check patches the method instead.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from . import _callsite
from ._callsite import CALLS, discards, instructions
from ._report import internal_error, is_internal, is_library
from ._tracebacks import hide_own_frames

AVAILABLE = sys.version_info >= (3, 12)
DISABLE = getattr(getattr(sys, "monitoring", None), "DISABLE", None)

#: ``handler(frame, method, receiver, itself)``: at a discarded call of a watched method (``itself``: it returned its
#: receiver; False for a method watched before the call); strict mode raises from it.
Handler = Callable[[FrameType, str, Any, bool], None]

_TOOL_IDS = (4, 3)
_NAME = "safetorch"
_MAX_CODES = 1 << 16
_getrefcount = sys.getrefcount


class _State:
    """The one owner of the watch's state."""

    def __init__(self) -> None:
        self.tool: int | None = None
        self.code = ""  # the rule whose watch this is (internal errors are reported under it)
        self.handler: Handler | None = None
        #: id(method) -> (method, name): the watched callables, torch's own methods
        self.methods: dict[int, tuple[Any, str]] = {}
        self.names: frozenset[str] = frozenset()
        #: the names of the methods whose handler is called after the call (`start`'s ``after``)
        self.after: frozenset[str] = frozenset()
        #: (id(code), offset) -> (method, receiver's id, its reference count before the call): a call of an ``after``
        #: method in progress at a site
        self.pending: dict[tuple[int, int], tuple[str, int, int]] = {}
        #: id(code) -> (weak reference to the code object, its sites): every code object read that has sites
        self.sites: dict[int, tuple[weakref.ref[CodeType], frozenset[int]]] = {}
        self.at_exit = False


_state = _State()


def sites_of(code: CodeType) -> frozenset[int]:
    """The offsets of the calls of ``code`` whose result is thrown away, as the call-site reader tells a discard
    (`safetorch._callsite.discards`: popped, or echoed by a notebook line that ends with ``;``)."""
    return frozenset(ins.offset for ins in instructions(code)
                     if ins.opname in CALLS and discards(code, ins.offset))


def _forget(key: int) -> Callable[[Any], None]:
    sites = _state.sites

    def forget(_: Any) -> None:
        sites.pop(key, None)

    return forget


def _read(code: CodeType) -> None:
    """Read ``code`` (once) and, when it has sites, watch its calls."""
    key = id(code)
    entry = _state.sites.get(key)
    if entry is not None and entry[0]() is code:
        return
    if (_state.names.isdisjoint(code.co_names) and "getattr" not in code.co_names) or is_internal(code):
        return
    sites = sites_of(code)
    if not sites:
        return
    if len(_state.sites) > _MAX_CODES:  # bounded: generated code makes code objects without end
        _state.sites.clear()
    _state.sites[key] = (weakref.ref(code, _forget(key)), sites)
    if _state.tool is not None:
        sys.monitoring.set_local_events(_state.tool, code, _local_events())


def _local_events() -> int:
    """A code object's events: its calls, and the returns of the C functions it calls (`_on_return`; CPython sets
    those two together with the raises), only where a site is."""
    events = sys.monitoring.events
    return events.CALL | events.C_RETURN | events.C_RAISE if _state.after else events.CALL


def _on_start(code: CodeType, offset: int, _disable: Any = DISABLE) -> Any:
    try:
        _read(code)
        _meet(code, sys._getframe(1))
    except Exception as exc:
        internal_error(_state.code, exc)
    return _disable


def _meet(code: CodeType, frame: FrameType | None) -> None:
    """Hand a function of the program's own (not a library's, not a module's body, which holds every function it
    defines) to the rules that read whole code objects once (`safetorch._callsite.meet`: ST021) as it starts: on 3.11
    they meet it where a patched method's call-site read does."""
    if _callsite._readers and frame is not None and frame.f_code is code and code.co_name != "<module>" \
            and not is_internal(code) and not is_library(code):
        _callsite.meet(frame)


def _watched(function: Any, arg0: Any) -> tuple[str, Any] | None | Any:
    """(method's name, receiver) when ``function`` is a watched method (or a bound method of a tensor under that
    name: ``f = x.view; f(2, 8)``); None for a call to look at again next time; `DISABLE` for one never to."""
    watched = _state.methods.get(id(function))
    if watched is not None and watched[0] is function:
        return watched[1], arg0
    name = getattr(function, "__name__", None)
    receiver = getattr(function, "__self__", None)
    if name not in _state.names:
        return DISABLE
    if receiver is None or _state.methods.get(id(getattr(type(receiver), name, None))) is None:
        return None  # a method of that name on something else (an array's `view`): it may be a tensor next time
    return name, receiver


def _on_call(code: CodeType, offset: int, function: Any, arg0: Any) -> Any:
    __tracebackhide__ = True  # noqa: F841
    entry = _state.sites.get(id(code))
    if entry is None or offset not in entry[1]:
        return DISABLE
    found = _watched(function, arg0)
    if found is None or found is DISABLE:
        return found
    name, receiver = found
    if name in _state.after:
        # The same references as `_on_return` holds when it counts again (``receiver``, ``found``'s tuple): the
        # difference is the result's.
        _state.pending[(id(code), offset)] = (name, id(receiver), _getrefcount(receiver))
        return None
    try:
        _call_handler(name, receiver, False)
    except BaseException as raised:  # strict mode: the finding raises at the user's line, with no frame of ours
        hide_own_frames(raised)
        raise
    return None


def _on_return(code: CodeType, offset: int, function: Any, arg0: Any) -> Any:
    __tracebackhide__ = True  # noqa: F841
    pending = _state.pending.pop((id(code), offset), None)
    if pending is None:
        return None
    found = _watched(function, arg0)
    if found is None or found is DISABLE:
        return None
    name, receiver = found
    if name != pending[0] or id(receiver) != pending[1]:
        return None
    count = _getrefcount(receiver)  # counted here, not as an argument: the call's arguments on the stack are more
    try:
        _call_handler(name, receiver, count == pending[2] + 1)
    except BaseException as raised:
        hide_own_frames(raised)
        raise
    return None


def _on_raise(code: CodeType, offset: int, function: Any, arg0: Any) -> Any:
    _state.pending.pop((id(code), offset), None)  # the call failed: nothing to report


def _call_handler(name: str, receiver: Any, itself: bool) -> None:
    __tracebackhide__ = True  # noqa: F841
    handler = _state.handler
    if handler is None:
        return
    try:
        handler(sys._getframe(2), name, receiver, itself)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(_state.code, exc)


def start(code: str, methods: dict[str, Any], handler: Handler, after: frozenset[str] = frozenset()) -> bool:
    """Watch the discarded calls of ``methods`` (name -> torch's callable) for the rule ``code``; those named in
    ``after`` once they have returned. False when this Python has no ``sys.monitoring`` or no tool id is free (the
    caller patches instead)."""
    if not AVAILABLE:
        return False
    if _state.tool is not None:
        stop()
    monitoring = sys.monitoring
    for tool in _TOOL_IDS:
        try:
            monitoring.use_tool_id(tool, _NAME)
        except ValueError:  # taken by another tool
            continue
        break
    else:
        return False
    _state.tool, _state.code, _state.handler = tool, code, handler
    _state.methods = {id(m): (m, name) for name, m in methods.items()}
    _state.names = frozenset(methods)
    _state.after = frozenset(after)
    _state.pending.clear()
    events = monitoring.events
    monitoring.register_callback(tool, events.PY_START, _on_start)
    monitoring.register_callback(tool, events.CALL, _on_call)
    monitoring.register_callback(tool, events.C_RETURN, _on_return)
    monitoring.register_callback(tool, events.C_RAISE, _on_raise)
    # The code objects read before (a code object reports its start once in the process): watched again.
    for ref, _ in list(_state.sites.values()):
        known = ref()
        if known is not None:
            monitoring.set_local_events(tool, known, _local_events())
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:  # what runs now: the program's module, the function that installed safetorch
        try:
            _read(frame.f_code)
            _meet(frame.f_code, frame)
        except Exception as exc:
            internal_error(code, exc)
        frame = frame.f_back
    monitoring.set_events(tool, events.PY_START)
    if not _state.at_exit:  # before the interpreter tears the modules down, which code still runs through
        _state.at_exit = True
        atexit.register(stop)
    return True


def stop() -> None:
    """Stop watching: every event of the tool off, its callbacks and its id given back."""
    tool = _state.tool
    if tool is None:
        return
    monitoring = sys.monitoring
    monitoring.set_events(tool, 0)
    for ref, _ in list(_state.sites.values()):
        known = ref()
        if known is not None:
            monitoring.set_local_events(tool, known, 0)
    for event in (monitoring.events.PY_START, monitoring.events.CALL, monitoring.events.C_RETURN,
                  monitoring.events.C_RAISE):
        monitoring.register_callback(tool, event, None)
    _state.pending.clear()
    monitoring.free_tool_id(tool)
    _state.tool, _state.handler = None, None


def watching() -> bool:
    return _state.tool is not None
