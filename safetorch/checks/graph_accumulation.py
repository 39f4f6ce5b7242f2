"""ST004: a tensor that carries a graph accumulated into a Python number (``total_loss += loss``).

``total_loss = 0.0; total_loss += loss`` turns ``total_loss`` into a tensor that holds the autograd graph of every
step it has summed: memory grows every step. Python calls ``Tensor.__radd__`` only when the left operand is not a
tensor, so ordinary tensor arithmetic never reaches this wrapper; for a number on the left it asks the call-site
reader whether the instruction is ``acc += x`` or ``acc = acc + x`` (the same name stored back). Look-alikes such as
``y = 1 + w`` or ``scale = 0.5 + w * 2`` are not accumulations and stay silent.

An accumulation into a number is also how a regularisation term is built (``l2 = 0.0; for p in params: l2 +=
p.norm()``), which is legitimate: it is part of this step's loss. So the finding is made at once only for a tensor
a backward() has already started from (``loss.backward(); total_loss += loss``); otherwise the node that starts the
sum is marked (`safetorch._graphs.mark`: its lifetime and whether a backward ran through it) and the sum is decided
at the coming backwards (`_decide`), or at exit.

The same graphs kept by a tensor summed in place, a list or a dict reach no wrapper: at the optimizer steps that
`safetorch._steps` looks at, the names the ``step()`` line and its callers see are noted, and one that a later look
finds grown with what the earlier saw still in it is reported at the line that fills it (`_look`). The memory they
hold is in the message (`safetorch._graphs.account`); an out-of-memory error gets a note naming them
(`crash_notes`, `safetorch._oom`).
"""

from __future__ import annotations

import ast
import sys
import weakref
from collections import deque
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from .. import _backward, _graphs, _losses, _oom, _steps
from .._callsite import Spot, accumulates, accumulation_names, call_source, fills, getline
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._patch import MethodPatch, Registry
from .._report import before_summary, internal_error, is_internal, report, report_at, user_frame
from .._rule import Rule
from .._tracebacks import hide_own_frames

CODE = "ST004"


class GraphAccumulationWarning(SafetorchWarning):
    """ST004: graphs no backward will consume kept across steps by an accumulator or a container."""

    code = "ST004"


RULE = Rule("ST004", "graph-accumulation", GraphAccumulationWarning,
            "graphs kept across steps by a number, a tensor, a list or a dict (total += loss)")

_is_compiling = is_compiling
_NUMBER = (int, float, complex)


def _accumulation(frame: FrameType | Spot) -> Any:
    """The accumulation the frame executes, parsed: its expression (3.11+), else its line's only accumulation."""
    text = call_source(frame)
    try:
        if text:
            return ast.parse(text.strip(), mode="exec").body[0]
        line = getline(frame.f_code.co_filename, frame.f_lineno, frame.f_globals)
        found = [n for n in ast.walk(ast.parse(line.strip())) if isinstance(n, ast.AugAssign) or (
            isinstance(n, ast.Assign) and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Add))]
    except SyntaxError:
        return None
    if len(found) != 1:
        return None
    return ast.Expr(found[0].value) if isinstance(found[0], ast.Assign) else found[0]


def _message(frame: FrameType | Spot, numel: int) -> tuple[str, str]:
    """The finding's head and its fix (``Write: ...``); a decision made later puts the memory held between them."""
    fix = ".item()" if numel == 1 else ".detach()"
    target = addend = None
    op = "+="
    node = _accumulation(frame)
    if isinstance(node, ast.AugAssign):
        target, addend = ast.unparse(node.target), node.value
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.BinOp):  # acc = acc + x: the BinOp's text
        target, addend = ast.unparse(node.value.left), node.value.right
        op = f"= {target} +"
    if call_source(frame) is None:  # no columns (3.10): what the bytecode proves names it, or nothing does
        proved, shown, in_place = accumulation_names(frame)
        if proved is not None and shown is not None:
            op = "+=" if in_place else f"= {proved} +"
            return (f"{CODE} {proved} {op} {shown} adds a tensor that requires grad to a Python number: {proved} "
                    f"becomes a tensor that keeps the autograd graph of every step it sums, and memory grows every "
                    f"step.", f"Write: {proved} {op} {shown}{fix}")
        if proved is not None:  # the accumulator is proved, what it adds is not a plain name
            return (f"{CODE} a tensor that requires grad is added to a Python number ({proved}): the sum becomes a "
                    f"tensor that keeps the autograd graph of every step it adds, and memory grows every step.",
                    f"Write: add the tensor's {fix} instead of the tensor")
    if target is None or addend is None:  # not known which accumulation of the line this is: no names
        return (f"{CODE} an accumulation at this line adds a tensor that requires grad to a Python number: the "
                f"accumulator becomes a tensor that keeps the autograd graph of every step it sums, and memory grows "
                f"every step.", f"Write: <accumulator> += <tensor>{fix}")
    shown = ast.unparse(addend)
    if not isinstance(addend, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
        shown = f"({shown})"
    return (f"{CODE} {target} {op} {shown} adds a tensor that requires grad to a Python number: {target} becomes "
            f"a tensor that keeps the autograd graph of every step it sums, and memory grows every step.",
            f"Write: {target} {op} {shown}{fix}")


# The tensors the last backward() calls started from (`_backward.recent`, which the patch keeps while this check
# records): accumulating one of them into a number is the pitfall for certain, its step is over. Only the last few are
# kept: one weak reference per backward, with no callback, is all a training step pays; an older one is still caught
# by the watch below.
_was_backwarded = _backward.was_recent


@dataclass
class _Watch:
    """An accumulator made from a tensor no backward() had used yet, and the marker on the node that started it
    (alive while the accumulation's graph is, ``consumed`` once a backward ran through it)."""

    result: weakref.ref[torch.Tensor]
    marker: weakref.ref[_graphs.Marker]
    filename: str
    lineno: int
    module_globals: dict[str, Any]
    spot: Spot  # the line, read for the message only when there is a finding
    numel: int
    created: int  # backwards started before the accumulation began
    version: int | None = None  # the accumulator's version at the first backward that looked at it
    looked: int = 0  # backwards that looked at it


_watches: dict[tuple[str, int], _Watch] = {}


_listening = [False]


def _listen() -> None:
    """Called before the backwards while something waits for them (a watch, a container kept): `_before_backward`
    leaves once nothing does. Never from a weak reference's callback (`_died`): `_backward.listen` takes a lock."""
    if not _listening[0]:
        _listening[0] = True
        _backward.listen(CODE, before=_before_backward)


class _RAdd(MethodPatch):
    """``Tensor.__radd__``, which Python calls only for ``number + tensor``: torch's, then a look at the call site."""

    @staticmethod
    def calling(wrapped: Any, name: str) -> Any:
        def radd(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            try:
                result = wrapped(*args, **kwargs)
                try:
                    if len(args) == 2:
                        instance, other = args
                        if instance.requires_grad and isinstance(other, _NUMBER) and not isinstance(other, bool):
                            frame = _getframe(1)
                            if accumulates(frame) and not _is_compiling() and not is_internal(frame.f_code):
                                if _was_backwarded(instance):
                                    report(CODE, frame, lambda: " ".join(_message(frame, instance.numel())))
                                else:
                                    _watch(frame, instance, result)
                except Exception as exc:  # strict-mode findings pass through internal_error
                    internal_error(CODE, exc)
                return result
            except BaseException as exc:  # no frame of ours in the traceback of what passes through
                hide_own_frames(exc)
                raise

        return radd


_getframe = sys._getframe


def _watch(frame: FrameType, value: torch.Tensor, result: Any) -> None:
    """``l2 = 0.0; for p in params: l2 += p.norm()`` builds a term of this step's loss: legitimate. The pitfall's
    accumulator instead outlives the steps it sums, with no backward through it. Watch the result, mark the node that
    starts its graph, and decide at the coming backwards (`_decide`), or at exit."""
    key = (frame.f_code.co_filename, frame.f_lineno)
    known = _watches.get(key)
    settled = known is None or (marker := known.marker()) is None or marker.consumed
    if isinstance(result, torch.Tensor) and settled:
        marker = _graphs.mark(result, key)
        if marker is not None:
            _watches[key] = _Watch(weakref.ref(result), weakref.ref(marker), key[0], key[1], frame.f_globals,
                                   Spot(frame), value.numel(), _backward.count)
            _listen()


def _before_backward(tensors: Any) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        if _watches:
            for key, watch in list(_watches.items()):
                if _decide(watch, _backward.count):
                    del _watches[key]
        if _due:
            _flush()
        if not (_watches or _kept or _due):
            _listening[0] = False
            _backward.unlisten(CODE)  # the backward iterates over a tuple of listeners: leaving it now is safe
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _decide(watch: _Watch, backwards: int) -> bool:
    """At a backward, before it runs: whether the watch is settled (reported, or found innocent).

    Innocent: its graph is gone, or a backward ran through it (a regularisation term, a loss summed over
    resolutions in one call, with any number of backwards per step). Found: the accumulator was added to again
    after a backward that did not consume it (it sums across steps); it sums a graph a backward had consumed before
    (the loss of an earlier step); or its graph survived `_SURVIVE` backwards unconsumed holding the saved tensors
    of several forwards (an evaluation's sum, kept under its own name or another: ``val = total / n``). Several
    backwards, not one: a GAN may sum its generator's loss before the discriminator's backward."""
    marker = watch.marker()
    if marker is None or marker.consumed:
        return True
    result = watch.result()
    watch.looked += 1
    if watch.looked == 1:
        watch.version = result._version if result is not None else None
        watch.created = backwards - 1 - watch.created  # from now on: backwards between the sum's start and this one
        return False
    if result is not None and watch.version is not None and result._version != watch.version:
        _report_watch(watch, [result], None)
        return True
    if watch.looked == 2 and result is not None:
        acc = _graphs.account([result], limit=_RELEASED_NODES)
        if acc.released:
            _report_watch(watch, [result], None)
            return True
    if watch.looked < _SURVIVE:
        return False
    if watch.created or (watch.version is not None and watch.version < _ADDS):
        return True  # a backward came while it was summed, or it is one or two terms: not an evaluation's sum
    holder = None
    tensors = [result] if result is not None else []
    if result is None:  # the accumulator is gone; its graph lives on in what was made of it (`val = total / n`)
        holder = _holder_of(marker)
        tensors = holder.tensors if holder is not None else []
    if tensors:
        acc = _graphs.account(tensors)
        if acc.bytes >= MIN_BYTES:
            _report_watch(watch, tensors, holder, acc)
    return True


_SURVIVE = 4  # backwards an unconsumed sum must outlive to be an evaluation's
_RELEASED_NODES = 512  # nodes walked to find a summed graph that a backward had consumed: its own come first
_ADDS = 2  # in-place additions after the first, with no backward between: a loop's sum, not one term
#: Bytes of saved tensors (the parameters' not counted) an unconsumed sum must hold to be an evaluation's: a
#: regularisation term saves the parameters themselves, and a few scalars.
MIN_BYTES = 64 * 1024


def _holder_of(marker: _graphs.Marker) -> _graphs.Holder | None:
    """The name, in the frames of the running code, that holds the graph carrying ``marker``."""
    return _holding(_graphs.holders(_frames(user_frame(sys._getframe(1)))), marker)


def _holding(found: list[_graphs.Holder], marker: _graphs.Marker) -> _graphs.Holder | None:
    for holder in found:
        if any(m is marker for m in _graphs.account(holder.tensors, limit=20_000).markers):
            return holder
    return None


_FRAMES = 6  # frames looked at, from the running line outwards


def _report_watch(watch: _Watch, tensors: list[torch.Tensor], holder: _graphs.Holder | None,
                  acc: _graphs.Account | None = None) -> None:
    head, fix = _message(watch.spot, watch.numel)
    acc = acc if acc is not None else _graphs.account(tensors)
    held = f" {holder.describe()} holds it now." if holder is not None else ""
    text = f"{head}{held} {_memory(acc)} Write: {fix.removeprefix('Write: ')}"
    report_at(CODE, watch.filename, watch.lineno, watch.module_globals, text, (watch.spot.f_code, watch.spot.f_lasti))


def _memory(acc: _graphs.Account, many: bool = False) -> str:
    """What kept graphs weigh, as the message says it."""
    subject = "Their graphs hold" if many else "Its graph holds"
    if acc.bytes:
        return f"{subject} {_graphs.human(acc.bytes)} of saved tensors ({acc.nodes} autograd nodes)."
    return f"{subject} {acc.nodes} autograd nodes (a backward freed their saved tensors)."


def _at_exit() -> None:
    """At exit: a sum made in a loop with no backward at all (an evaluation script without ``no_grad``), and the
    containers an evaluation filled (`_loss_look`)."""
    try:
        _flush(at_exit=True)
        for key, watch in list(_watches.items()):
            marker = watch.marker()
            result = watch.result()
            if marker is None or marker.consumed or result is None or watch.looked:
                continue
            del _watches[key]
            acc = _graphs.account([result])
            if result._version >= _ADDS and acc.bytes >= MIN_BYTES:
                _report_watch(watch, [result], None, acc)
    except Exception as exc:
        internal_error(CODE, exc)


# --- holders seen at looked-at optimizer steps ------------------------------------------------------------------


@dataclass
class _Seen:
    """A holder as a looked-at step saw it: the object (by id: a list takes no weak reference), its length, its first
    item that carries a graph, and for a tensor its version and the marker on its node."""

    ident: int
    length: int
    first: weakref.ref[torch.Tensor] | None
    version: int = 0
    marker: weakref.ref[_graphs.Marker] | None = None


_seen: dict[tuple[str, int, str, str], _Seen] = {}
_SEEN = 1024


def _look(optimizer: Any, look: int, caller: FrameType, more: bool) -> None:
    """A looked-at step: the names the ``step()`` line and its callers see that hold tensors carrying a graph. One
    that a later looked-at step finds grown, with what the earlier one saw still in it — a list or dict with more
    items and the same first one, a tensor summed into again (in place, or a new sum whose graph holds the one seen)
    with no backward through it — keeps graphs across
    steps: reported at the line that fills it. A rollout backwarded later and cleared, a list made anew each step,
    a loss rebound each step: each look sees another object, or another first item."""
    __tracebackhide__ = True  # noqa: F841
    try:
        frames = _frames(user_frame(caller))
        for holder in _graphs.holders(frames):
            code = holder.frame.f_code
            key = (code.co_filename, code.co_firstlineno, code.co_name, holder.name)
            seen = _seen.get(key)
            if seen is not None and _grew(seen, holder):
                _report_holder(holder, frames)
            if len(_seen) > _SEEN:
                _seen.clear()
            _seen[key] = _sight(holder)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _frames(frame: FrameType | None) -> list[FrameType]:
    frames: list[FrameType] = []
    while frame is not None and len(frames) < _FRAMES:
        if not is_internal(frame.f_code):
            frames.append(frame)
        frame = frame.f_back
    return frames


def _sight(holder: _graphs.Holder) -> _Seen:
    value = holder.value
    if isinstance(value, torch.Tensor):
        marker = _graphs.mark(value) if _summed(value) else None
        return _Seen(id(value), 1, weakref.ref(value), value._version, weakref.ref(marker) if marker else None)
    return _Seen(id(value), len(value), weakref.ref(holder.tensors[0]))


def _summed(t: torch.Tensor) -> bool:
    return t.grad_fn is not None and t.grad_fn.name().startswith("AddBackward")


def _grew(seen: _Seen, holder: _graphs.Holder) -> bool:
    value = holder.value
    if seen.first is None:
        return False
    if isinstance(value, torch.Tensor):
        marker = seen.marker() if seen.marker is not None else None
        if marker is None or marker.consumed:
            return False
        if seen.first() is value:  # summed in place: ``total += loss``
            return value._version != seen.version
        return _summed(value) and _reaches(value, marker)  # ``total = total + loss``: a new sum over the old one
    if id(value) != seen.ident:
        return False
    first = seen.first()
    return len(value) > seen.length and first is not None and any(t is first for t in holder.tensors[:8])


def _reaches(t: torch.Tensor, marker: _graphs.Marker, limit: int = 256) -> bool:
    """Whether the graph of ``t`` holds the node ``marker`` marks: the sum a looked-at step saw, under a new one."""
    queue = deque([t.grad_fn])
    seen: set[int] = set()
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if _graphs.marker_of(node) is marker:
            return True
        queue.extend(child for child, _ in node.next_functions)
    return False


# --- containers filled while losses are computed with no backward (an evaluation without no_grad) -----------------


@dataclass
class _Kept:
    """A container a looked-at loss call found grown since the one before, with no backward between: the marker on
    its first graph tells whether a backward consumed it (a rollout) by the time that graph dies (an evaluation's
    list, gone when its function returns) or the program exits."""

    key: tuple[str, int, str, str]
    marker: _graphs.Marker
    where: tuple[str, int, dict[str, Any]]
    message: str
    death: weakref.ref[_Death] | None = None


class _Death:
    """Put in the node's metadata beside its marker: its weak reference's callback tells when the node is gone."""

    __slots__ = ("__weakref__",)


_loss_seen: dict[tuple[str, int, str, str], _Seen] = {}
_kept: dict[tuple[str, int, str, str], _Kept] = {}
_due: list[_Kept] = []
_loss_backwards = [-1]  # the backward count at the last looked-at loss call


def _loss_look(frame: FrameType) -> None:
    """A looked-at loss call with autograd on (`safetorch._losses`: the first 32, then one in 64). The first after a
    backward only notes the backward count (a training step's look reads nothing); a later one, with no backward
    since, reads the names of the program's frames: a list or dict grown since the previous look, its first graph
    still in it, is an evaluation's (or a rollout's): decided when its first graph dies or at exit."""
    __tracebackhide__ = True  # noqa: F841
    try:
        if _due:
            _flush()
        if _backward.count != _loss_backwards[0]:
            _loss_backwards[0] = _backward.count
            _loss_seen.clear()  # a backward came between: training, which the looked-at steps follow
            return  # nothing read: a training step's look costs one comparison
        frames = _frames(user_frame(frame))
        for holder in _graphs.holders(frames):
            if isinstance(holder.value, torch.Tensor):
                continue  # sums: a number's is followed from its first addition, a tensor's at the looked-at steps
            code = holder.frame.f_code
            key = (code.co_filename, code.co_firstlineno, code.co_name, holder.name)
            seen = _loss_seen.get(key)
            if seen is not None and key not in _kept and _grew(seen, holder):
                _keep(key, holder, frames)
            if len(_loss_seen) > _SEEN:
                _loss_seen.clear()
            _loss_seen[key] = _sight(holder)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _keep(key: tuple[str, int, str, str], holder: _graphs.Holder, frames: list[FrameType]) -> None:
    node = holder.tensors[0].grad_fn
    marker = _graphs.mark(holder.tensors[0])
    if node is None or marker is None or marker.consumed:
        return
    where = _filled(holder, frames)
    statement = _graphs.statement_of(getline(where[0], where[1], where[2]), holder.name)
    message = holder_message(holder, statement, _graphs.account(holder.tensors))
    message = message.replace(f"{len(holder.value)} items)", f"{len(holder.value)} items when seen)", 1).replace(
        f"holds {holder.graphs} graphs across steps", f"holds {holder.graphs} graphs or more across iterations", 1)
    kept = _Kept(key, marker, where, message)
    death = _Death()
    node.metadata[_graphs.TAG + ".death"] = death
    kept.death = weakref.ref(death, lambda _, kept=kept: _died(kept))
    _kept[key] = kept
    _listen()


def _died(kept: _Kept) -> None:
    """The container's first graph is gone (a weak reference's callback: only noted here)."""
    if _kept.get(kept.key) is kept:
        del _kept[kept.key]
        if not kept.marker.consumed:
            _due.append(kept)


def _flush(at_exit: bool = False) -> None:
    """Report the containers whose first graph died unused (at a loss call, a backward, exit), and at exit those
    still alive that no backward consumed."""
    if at_exit:
        for kept in list(_kept.values()):
            if not kept.marker.consumed:
                _due.append(kept)
        _kept.clear()
    while _due:
        kept = _due.pop(0)
        filename, lineno, module_globals = kept.where
        report_at(CODE, filename, lineno, module_globals, lambda kept=kept: kept.message)


def _report_holder(holder: _graphs.Holder, frames: list[FrameType]) -> None:
    where = _filled(holder, frames)
    acc = _graphs.account(holder.tensors)
    filename, lineno, module_globals = where
    statement = _graphs.statement_of(getline(filename, lineno, module_globals), holder.name)
    report_at(CODE, filename, lineno, module_globals, lambda: holder_message(holder, statement, acc))


def _filled(holder: _graphs.Holder, frames: list[FrameType]) -> tuple[str, int, dict[str, Any]]:
    """Where the holder is filled: the first line of the frames' code that puts into it, else where it is seen."""
    for frame in [holder.frame, *frames]:
        line = fills(frame.f_code, holder.name)
        if line is not None:
            return frame.f_code.co_filename, line, frame.f_globals
    return holder.frame.f_code.co_filename, holder.frame.f_lineno, holder.frame.f_globals


def holder_message(holder: _graphs.Holder, statement: str, acc: _graphs.Account) -> str:
    """``ST004 `losses.append(loss)` keeps ...: `losses` (list, 240 items) holds 240 graphs ... Write: ...``"""
    scalar = all(t.numel() == 1 for t in holder.tensors[:8])
    fix = _graphs.fixed(statement, ".item()" if scalar else ".detach()")
    shown = f"`{statement}`" if statement and len(statement) <= 100 else "this line"
    if isinstance(holder.value, torch.Tensor):
        what = (f"{shown} adds a tensor that requires grad to the tensor `{holder.name}`: it keeps the autograd graph "
                f"of every step it sums, and no backward goes through it.")
    else:
        unused = ", that no backward has consumed" if acc.bytes else ""
        what = (f"{shown} keeps the autograd graph of every tensor it stores: {holder.describe()} holds "
                f"{holder.graphs} graphs across steps{unused}.")
    return f"{CODE} {what} {_memory(acc, not isinstance(holder.value, torch.Tensor))} Write: {fix}"


def crash_notes(exc: BaseException) -> list[str]:
    """For an out-of-memory error: what holds the graphs no backward has consumed (`safetorch._oom`)."""
    note = _oom.note(exc)
    return [note] if note else []


def install(registry: Registry) -> None:
    registry.method(torch.Tensor, "__radd__", _RAdd, CODE)
    _backward.record(CODE)
    _steps.listen(CODE, _look)
    _losses.listen(CODE, every=_loss_look)
    before_summary(CODE, _at_exit)
    _oom.reserve()


def uninstall() -> None:
    _backward.record(CODE, False)
    _backward.unlisten(CODE)
    _listening[0] = False
    _steps.unlisten(CODE)
    _losses.unlisten(CODE)
    before_summary(CODE, None)
    _watches.clear()
    _seen.clear()
    _loss_seen.clear()
    _kept.clear()
    _due.clear()
    _loss_backwards[0] = -1
    _oom.release()
