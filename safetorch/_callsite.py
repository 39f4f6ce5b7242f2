"""Reads the caller's bytecode: is the value being returned discarded? Is this addition an accumulation?

Design rules:
- Built from `dis` for Python 3.10-3.13, never from hard-coded offsets or opcode numbers.
- Every answer is cached per (code object, instruction offset), keyed by ``id(code)`` with the code object kept in
  the entry: hashing a code object hashes its whole bytecode (hundreds of ns), an int pair does not, and holding the
  code alive means its id cannot be reused for another one. A hot loop pays one dict lookup.
- On 3.11+ ``f_lasti`` can point into the inline CACHE entries that follow a call: the "next" instruction is the
  first real one after ``f_lasti``.
- Source text is read only to word a message, once per call site.
- The caches are bounded (generated code and long notebooks make call sites without end): past a size, the older
  half is dropped, and a dropped site is simply read again. `clear` empties them (``uninstall()`` calls it).
"""

from __future__ import annotations

import ast
import bisect
import dis
import inspect
import io
import keyword
import linecache
import sys
import tokenize
from collections.abc import MutableMapping, MutableSequence
from inspect import CO_OPTIMIZED
from types import CodeType, FrameType
from typing import Any

__all__ = ["Spot", "accumulates", "call_source", "callee", "calls_method", "clear", "discards", "fills", "getline",
           "instructions", "is_discarded", "frame_locals", "meet", "method_call", "normalized", "on_new_code",
           "parsed_call", "producer_index", "quoted_call", "source_line", "span", "span_source", "trim", "value_of"]

_SNAPSHOT = sys.version_info < (3, 13)


def frame_locals(frame: FrameType) -> dict[str, Any]:
    """The frame's local variables. Before Python 3.13 a function frame's ``f_locals`` is a snapshot that the frame
    keeps, holding every value it copied until the frame ends: read at an optimizer step of a training function, it
    would keep that step's loss, and its graph, alive for the rest of training. So a function frame's snapshot is
    copied and emptied (a later read — ``locals()``, a debugger's — fills it again); a module's or a class body's
    namespace is the real one, and is returned as it is."""
    scope = frame.f_locals
    if _SNAPSHOT and frame.f_code.co_flags & CO_OPTIMIZED and scope is not frame.f_globals:
        copy = dict(scope)
        scope.clear()
        return copy
    return scope


# Instructions that neither push nor pop: skipped when looking for the producer of a value.
_NO_STACK = {"NOP", "EXTENDED_ARG", "CACHE", "RESUME", "NOT_TAKEN"}
_LOADS = {"LOAD_FAST", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FAST_CHECK",
          "LOAD_FAST_BORROW", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW", "STORE_FAST_LOAD_FAST"}
_STORES = {"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF", "STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST"}


def _loaded(ins: dis.Instruction) -> Any:
    """The name an instruction pushes last: a fused ``STORE_FAST_LOAD_FAST (a, b)`` (3.13) stores a, then loads b;
    ``LOAD_FAST_LOAD_FAST (a, b)`` pushes a then b, and the left operand of a binary op is the first."""
    if isinstance(ins.argval, tuple):
        return ins.argval[1] if ins.opname.startswith("STORE_") else ins.argval[0]
    return ins.argval


def _stored(ins: dis.Instruction) -> Any:
    """The name a store instruction writes the top of the stack to (the first of a fused pair)."""
    return ins.argval[0] if isinstance(ins.argval, tuple) else ins.argval


class _CodeInfo:
    """The instructions of one code object, with their offsets for bisecting."""

    __slots__ = ("code", "instructions", "offsets")

    def __init__(self, code: CodeType) -> None:
        self.code = code
        self.instructions = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
        self.offsets = [i.offset for i in self.instructions]

    def index_at(self, lasti: int) -> int:
        """Index of the instruction that contains offset ``lasti``."""
        return bisect.bisect_right(self.offsets, lasti) - 1


_code_infos: dict[int, _CodeInfo] = {}
# Keyed by id(code) + offset, an int (no tuple to build on the hot path). From 3.11 the bytecode lies inside the code
# object, so two live code objects never share a key; on 3.10 a shared key is only a cache miss, since the entry's
# code object is checked.
_discarded: dict[int, tuple[CodeType, bool]] = {}
#: A call site whose result is used, as ``{f_lasti: code}`` (filled by ST001, the one hot path that asks): one lookup
#: and one ``is``, without building ``id(code) + f_lasti``. Two sites at the same offset of different code objects
#: take turns: each miss asks `is_discarded`, whose answer is cached.
_kept: dict[int, CodeType] = {}
_accumulates: dict[tuple[int, int], tuple[CodeType, bool]] = {}

#: Entries kept per cache before the older half is dropped: `_CodeInfo` holds a code object's whole instruction list.
MAX_CODE_INFOS = 256
MAX_ANSWERS = 1 << 16


def trim(cache: dict[Any, Any], limit: int) -> None:
    """Drop the older half of a cache that has grown past ``limit`` (dicts keep insertion order)."""
    if len(cache) > limit:
        for key in list(cache)[: len(cache) // 2]:
            cache.pop(key, None)


def clear() -> None:
    """Forget every cached answer (and the code objects they keep alive)."""
    _code_infos.clear()
    _discarded.clear()
    _kept.clear()
    _accumulates.clear()
    _calls.clear()


#: Called with a frame whose call site the reader reads for the first time (a rule that reads a whole code object
#: once, ST021, keeps its own record of the code objects it has read). Only slow paths call them: never per call.
_readers: dict[str, Any] = {}


def on_new_code(name: str, reader: Any | None) -> None:
    """Add (or, with None, remove) ``reader(frame)``, called where the reader meets a call site it has not read."""
    if reader is None:
        _readers.pop(name, None)
    else:
        _readers[name] = reader


def meet(frame: FrameType) -> None:
    """Hand a frame met on a slow path to every reader (its code object may be new to them)."""
    for reader in tuple(_readers.values()):
        reader(frame)


def instructions(code: CodeType) -> list[dis.Instruction]:
    """The code object's instructions without CACHE entries (cached with the call-site answers)."""
    return _info(code).instructions


def _info(code: CodeType) -> _CodeInfo:
    info = _code_infos.get(id(code))
    if info is None or info.code is not code:
        trim(_code_infos, MAX_CODE_INFOS)
        info = _code_infos[id(code)] = _CodeInfo(code)
    return info


def _next_instruction(code: CodeType, lasti: int) -> dis.Instruction | None:
    info = _info(code)
    i = bisect.bisect_right(info.offsets, lasti)
    return info.instructions[i] if i < len(info.instructions) else None


def is_discarded(frame: FrameType) -> bool:
    """True when the value the frame's current call returns is thrown away (the next instruction is POP_TOP).

    The REPL's echo of an expression statement is PRINT_EXPR / CALL_INTRINSIC_1, not POP_TOP: not a discard.
    """
    code = frame.f_code
    entry = _discarded.get(id(code) + frame.f_lasti)
    if entry is not None and entry[0] is code:
        return entry[1]
    if _readers:
        meet(frame)
    return _discarded_slow(code, frame.f_lasti)


def discards(code: CodeType, lasti: int, *, cache: bool = True) -> bool:
    """`is_discarded` for the call at ``lasti`` of ``code`` read ahead of it (no frame runs it yet), cached alike
    unless ``cache`` is False (an answer in the cache is one that `is_discarded` gives without meeting the frame)."""
    entry = _discarded.get(id(code) + lasti)
    if entry is not None and entry[0] is code:
        return entry[1]
    return _discarded_slow(code, lasti, cache)


def _discarded_slow(code: CodeType, lasti: int, cache: bool = True) -> bool:
    nxt = _next_instruction(code, lasti)
    answer = nxt is not None and (nxt.opname == "POP_TOP" or (_echoes(nxt) and _quieted(code, lasti)))
    if cache:
        trim(_discarded, MAX_ANSWERS)
        _discarded[id(code) + lasti] = (code, answer)
    return answer


def _echoes(ins: dis.Instruction) -> bool:
    """The REPL's (and IPython's last-line) echo of an expression statement: PRINT_EXPR, or 3.12's intrinsic."""
    return ins.opname == "PRINT_EXPR" or (ins.opname == "CALL_INTRINSIC_1" and "PRINT" in str(ins.argrepr))


def _quieted(code: CodeType, lasti: int) -> bool:
    """An echoed expression whose line ends with ``;``: IPython then shows nothing (a notebook's way to discard)."""
    info = _info(code)
    lineno = None
    for ins in reversed(info.instructions[: info.index_at(lasti) + 1]):
        starts = ins.starts_line  # 3.10-3.12: the line number or None; 3.13: a bool, with line_number beside it
        lineno = getattr(getattr(ins, "positions", None), "lineno", None) or getattr(ins, "line_number", None) or (
            starts if type(starts) is int else None)
        if lineno:
            break
    if not lineno:
        return False
    text = getline(code.co_filename, int(lineno)).split("#", 1)[0].rstrip()
    return text.endswith(";")


def _producer(instructions: list[dis.Instruction], index: int, depth: int) -> dis.Instruction | None:
    """The instruction that pushed the stack item ``depth`` places below the top, just before ``index``.

    Walks back over straight-line code only; anything it cannot follow (a jump target in between) gives None.
    """
    j = producer_index(instructions, index, depth)
    return instructions[j] if j is not None else None


def producer_index(instructions: list[dis.Instruction], index: int, depth: int) -> int | None:
    """`_producer`, as the index of the instruction in ``instructions``."""
    need = depth
    for j in range(index - 1, max(index - 64, -1), -1):
        ins = instructions[j]
        if ins.opname in _NO_STACK:
            continue
        effect = dis.stack_effect(ins.opcode, ins.arg, jump=False) if ins.opcode >= dis.HAVE_ARGUMENT else \
            dis.stack_effect(ins.opcode, jump=False)
        if need == 0 or need - effect < 0:
            return j
        need -= effect
        if ins.is_jump_target:
            return None
    return None


def _is_accumulation(code: CodeType, lasti: int) -> bool:
    info = _info(code)
    idx = info.index_at(lasti)
    if idx < 0:
        return False
    op = info.instructions[idx]
    if op.opname == "INPLACE_ADD" or (op.opname == "BINARY_OP" and op.argrepr == "+="):
        return True
    if not (op.opname == "BINARY_ADD" or (op.opname == "BINARY_OP" and op.argrepr == "+")):
        return False
    if idx + 1 >= len(info.instructions):
        return False
    store = info.instructions[idx + 1]
    if store.opname not in _STORES:
        return False
    left = _producer(info.instructions, idx, 1)
    if left is None or left.opname not in _LOADS:
        return False
    return bool(_loaded(left) == _stored(store))


def accumulation_names(frame: FrameType) -> tuple[str | None, str | None, bool]:
    """For a frame executing ``acc += x`` or ``acc = acc + x``: (the name stored back, the name added, whether it is
    ``+=``), each name as the bytecode proves it, or None — an attribute, a subscript or an expression is not named
    (without the columns of 3.11's ``co_positions()``, a source line cannot tell which statement of the line, or
    which part of it, runs)."""
    info = _info(frame.f_code)
    idx = info.index_at(frame.f_lasti)
    if idx < 0 or idx + 1 >= len(info.instructions):
        return None, None, True
    op, store = info.instructions[idx], info.instructions[idx + 1]
    if op.opname not in ("INPLACE_ADD", "BINARY_ADD") and op.argrepr not in ("+=", "+"):
        return None, None, True  # not an addition: nothing is proved
    target = _stored(store) if store.opname in _STORES else None
    added = _producer(info.instructions, idx, 0)
    addend = None
    if added is not None and added.opname in _LOADS:
        # the top of the stack: the second name of a fused pair that loads two (3.13's LOAD_FAST_LOAD_FAST)
        addend = added.argval[-1] if isinstance(added.argval, tuple) else added.argval
    in_place = op.opname == "INPLACE_ADD" or op.argrepr == "+="
    return (target if isinstance(target, str) else None), (addend if isinstance(addend, str) else None), in_place


def accumulates(frame: FrameType) -> bool:
    """True when the frame is executing ``acc += value`` or ``acc = acc + value`` (same name stored back)."""
    code = frame.f_code
    key = (id(code), frame.f_lasti)
    entry = _accumulates.get(key)
    if entry is not None and entry[0] is code:
        return entry[1]
    if _readers:
        meet(frame)
    answer = _is_accumulation(code, frame.f_lasti)
    trim(_accumulates, MAX_ANSWERS)
    _accumulates[key] = (code, answer)
    return answer


#: Methods that put an item into a container (a list's, a dict's, a deque's, a set's).
_FILLERS = frozenset({"append", "extend", "insert", "update", "setdefault", "add", "appendleft", "extendleft"})


def _line_at(code: CodeType, offset: int) -> int | None:
    for start, end, number in code.co_lines():
        if start <= offset < end:
            return number
    return None


def _names(ins: dis.Instruction, target: str, attribute: bool) -> bool:
    """Whether ``ins`` loads (or stores, for a store) the holder: a variable, or an attribute (``self.losses``)."""
    if attribute:
        return ins.opname in ("LOAD_ATTR", "STORE_ATTR") and ins.argval == target
    if ins.opname in _LOADS:
        return bool(_loaded(ins) == target)
    return ins.opname in _STORES and _stored(ins) == target


def _container(instructions: list[dis.Instruction], index: int, target: str, attribute: bool) -> bool:
    """Whether the ``STORE_SUBSCR`` at ``index`` stores into ``target`` (``d[k] = v``: the item below the key). A
    fused load (3.13's ``LOAD_FAST_LOAD_FAST (v, d)``) pushes two names: they are read in the order pushed."""
    producer = _producer(instructions, index, 1)
    if producer is None:
        return False
    if not isinstance(producer.argval, tuple):
        return _names(producer, target, attribute)
    pushed: list[Any] = []
    for ins in reversed(instructions[max(index - 3, 0): index]):
        if ins.opname not in _LOADS or ins.opname.startswith("STORE_"):
            break
        pushed[:0] = list(ins.argval) if isinstance(ins.argval, tuple) else [ins.argval]
    return not attribute and len(pushed) >= 2 and pushed[-2] == target


def fills(code: CodeType, name: str) -> int | None:
    """The first line of ``code`` that puts something into the holder ``name`` (``losses.append(x)``,
    ``d[k] = x``, ``total += x``; ``self.losses`` for an attribute), or None. Read from the bytecode, once per
    finding: `safetorch._graphs` names the line where a kept graph's holder is filled."""
    attribute = "." in name
    target = name.rsplit(".", 1)[-1]
    instructions = _info(code).instructions
    for i, ins in enumerate(instructions):
        nxt = instructions[i + 1] if i + 1 < len(instructions) else None
        if nxt is not None and ins.opname in (*_LOADS, "LOAD_ATTR") and _names(ins, target, attribute) \
                and nxt.opname in ("LOAD_METHOD", "LOAD_ATTR") and nxt.argval in _FILLERS:
            return _line_at(code, ins.offset)
        if ins.opname == "STORE_SUBSCR" and _container(instructions, i, target, attribute):
            return _line_at(code, ins.offset)
        if ins.opname == "INPLACE_ADD" or (ins.opname == "BINARY_OP" and ins.argrepr == "+="):
            for store in instructions[i + 1: i + 3]:
                if store.opname in (*_STORES, "STORE_ATTR") and _names(store, target, attribute):
                    return _line_at(code, ins.offset)
        if (ins.opname == "BINARY_ADD" or (ins.opname == "BINARY_OP" and ins.argrepr == "+")) \
                and any(store.opname in (*_STORES, "STORE_ATTR") and _names(store, target, attribute)
                        for store in instructions[i + 1: i + 3]) \
                and any(_mentions(load, target, attribute) for load in instructions[max(0, i - 12): i]):
            return _line_at(code, ins.offset)  # ``total = total + x``
    return None


def _mentions(ins: dis.Instruction, target: str, attribute: bool) -> bool:
    """Whether ``ins`` loads the holder, also as one of a fused load's two names (3.13's ``LOAD_FAST_LOAD_FAST``)."""
    if not attribute and ins.opname in _LOADS and isinstance(ins.argval, tuple):
        return target in ins.argval
    return ins.opname in (*_LOADS, "LOAD_ATTR") and _names(ins, target, attribute)


def source_line(frame: FrameType) -> str:
    """The stripped source line the frame is executing, or '' when it cannot be read."""
    return getline(frame.f_code.co_filename, frame.f_lineno, frame.f_globals).strip()


def getline(filename: str, lineno: int, module_globals: dict[str, Any] | None = None) -> str:
    """A source line, or '' when it cannot be read (files, notebook cells, loaders given by ``module_globals``)."""
    try:
        return linecache.getline(filename, lineno, module_globals)
    except (ImportError, OSError):  # a loader that cannot serve this module's source under its run name
        return linecache.getline(filename, lineno)


def span(code: CodeType, lasti: int, module_globals: dict[str, Any] | None = None
         ) -> tuple[int, int, int, int] | None:
    """(line, column, end line, end column) of the expression the instruction at ``lasti`` evaluates, as Python's
    ``ast`` counts them (lines from 1, columns from 0 in UTF-8 bytes), from the bytecode's positions (3.11+); None
    before 3.11, where code objects have none, or for an instruction without a position. A method call written over
    several lines starts at its receiver (`_receiver_start`)."""
    if sys.version_info < (3, 11):
        return None
    index = lasti // 2
    for i, position in enumerate(code.co_positions()):
        if i == index:
            line, end_line, col, end_col = position
            if line is None or end_line is None or col is None or end_col is None:
                return None
            line, col = _receiver_start(code, line, col, module_globals)
            return line, col, end_line, end_col
    return None


def span_source(filename: str, where: tuple[int, int, int, int], module_globals: dict[str, Any] | None = None
                ) -> str | None:
    """The source text of a `span` in a file (its lines as Python decodes them), or None when it cannot be read."""
    line, col, end_line, end_col = where
    lines = [getline(filename, n, module_globals) for n in range(line, end_line + 1)]
    if not lines or not all(lines):
        return None
    encoded = [ln.encode() for ln in lines]  # columns are in UTF-8 bytes
    if len(encoded) == 1:
        return encoded[0][col:end_col].decode(errors="replace")
    parts = [encoded[0][col:], *encoded[1:-1], encoded[-1][:end_col]]
    return b"".join(parts).decode(errors="replace")


def call_source(frame: FrameType) -> str | None:
    """The source text of the expression the frame is evaluating at ``f_lasti`` (3.11+); on 3.10, which has no
    columns, the one call on the frame's line to the function or method the instruction calls; else None."""
    code = frame.f_code
    where = span(code, frame.f_lasti, frame.f_globals)
    if where is not None:
        return span_source(code.co_filename, where, frame.f_globals)
    if sys.version_info >= (3, 11):
        return None
    return _only_call_on_line(frame)


#: The instructions that call, on every Python (3.10's three, 3.11+'s ``CALL``, 3.13's ``CALL_KW``).
CALLS = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION_EX", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW"})
_CALLS_310 = frozenset({"CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW"})


def callee_index(instructions: list[dis.Instruction], index: int) -> int | None:
    """The index of the instruction that pushed the callable of the call at ``index`` (`CALLS`): ``LOAD_METHOD view``
    for ``x.view(2, 8)``; None where straight-line code cannot tell."""
    call = instructions[index]
    arg = call.arg or 0
    if call.opname == "CALL_FUNCTION_EX":
        depth = 1 + (arg & 1)  # the arguments' tuple, and their dict
    elif call.opname == "CALL_FUNCTION_KW":
        depth = arg + 1  # the names' tuple above the arguments
    else:
        depth = arg
    start = index - 1 if index and instructions[index - 1].opname == "PRECALL" else index  # 3.11
    return producer_index(instructions, start, depth)


def _only_call_on_line(frame: FrameType) -> str | None:
    """3.10: the source of the only call on the line whose callee has the name the bytecode calls (``model(x)``,
    ``ddp.module.double()``); None where there is none or more than one."""
    try:
        instructions = _info(frame.f_code).instructions
        index = next((i for i, ins in enumerate(instructions) if ins.offset == frame.f_lasti), None)
        if index is None or instructions[index].opname not in _CALLS_310:
            return None
        callee = callee_index(instructions, index)
        if callee is None or not isinstance(instructions[callee].argval, str):
            return None
        name = instructions[callee].argval
        line = getline(frame.f_code.co_filename, frame.f_lineno, frame.f_globals).strip()
        found = [node for node in ast.walk(ast.parse(line)) if isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Name) and node.func.id == name)
            or (isinstance(node.func, ast.Attribute) and node.func.attr == name))]
        return ast.get_source_segment(line, found[0]) if len(found) == 1 else None
    except (SyntaxError, ValueError):
        return None


def _receiver_start(code: CodeType, line: int, col: int, module_globals: dict[str, Any]) -> tuple[int, int]:
    """Where a method call's expression starts. From 3.11 a call written over several lines starts at the method's
    name (``(x`` / ``.double()`` / ``.float())`` reads ``float()``): then the start moves back over the dots, names
    and bracketed groups of the receiver, as far as 20 lines up; (line, col) as they were when no dot comes first."""
    first = max(1, line - 20)
    lines = [getline(code.co_filename, n, module_globals) for n in range(first, line + 1)]
    if not lines[-1]:
        return line, col
    text = "".join(lines[:-1]) + lines[-1].encode()[:col].decode(errors="replace")
    j = _space_before(text, len(text))
    if j == 0 or text[j - 1] != ".":
        return line, col
    while j > 0 and text[j - 1] == ".":
        j = _space_before(text, j - 1)
        while j > 0 and text[j - 1] in ")]":
            opened = _opening(text, j - 1)
            if opened is None:
                return line, col
            j = opened
        while j > 0 and (text[j - 1].isalnum() or text[j - 1] == "_"):
            j -= 1
        k = _space_before(text, j)
        if k > 0 and text[k - 1] == ".":
            j = k
    before = text[:j]
    row = before.count("\n")
    return first + row, len(before[before.rfind("\n") + 1:].encode())


def _space_before(text: str, j: int) -> int:
    while j > 0 and text[j - 1].isspace():
        j -= 1
    return j


def _opening(text: str, j: int) -> int | None:
    """The index of the bracket that the closing bracket at ``j`` closes (strings not parsed), or None."""
    depth = 0
    for k in range(j, -1, -1):
        if text[k] in ")]}":
            depth += 1
        elif text[k] in "([{":
            depth -= 1
            if depth == 0:
                return k
    return None


def quoted_call(frame: FrameType, fallback: str, limit: int = 100) -> str:
    """The call at the frame's instruction as a message shows it (```F.dropout(x, 0.5)```, on one line: see
    `normalized`), or ``fallback`` when its source cannot be read or is longer than ``limit``."""
    call = call_source(frame)
    shown = normalized(call) if call else ""
    return f"`{shown}`" if shown and len(shown) <= limit else fallback


_OPENERS, _CLOSERS = frozenset("([{"), frozenset(")]}")
_SKIPPED_TOKENS = frozenset({tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                             tokenize.ENDMARKER})


def normalized(text: str) -> str:
    r"""An expression's source on one line, as a message quotes it: a call written over several lines,
    ``x.to(\n    torch.float64,\n)``, reads ``x.to(torch.float64)``. Line breaks, indentation and comments go, and
    so does a trailing comma before a closing bracket where it changes nothing (a call's, a list's; not the one of
    ``(a,)`` or ``t[i,]``); there is no space just inside brackets or before a comma. Everything else stays as the
    user wrote it (quotes, spacing around operators), unlike ``ast.unparse``, which rewrites ``d["a"]`` as
    ``d['a']``. Source that does not tokenize has its whitespace folded."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(text.strip()).readline)
                  if t.type not in _SKIPPED_TOKENS]
    except (tokenize.TokenError, SyntaxError):
        return " ".join(text.split())
    lines = text.strip().splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    source = "".join(lines)
    out: list[str] = []
    # Per open bracket: whether a trailing comma before its closer changes nothing, and the commas seen inside it.
    brackets: list[list[Any]] = []
    previous: tokenize.TokenInfo | None = None
    depth_in_string, string_start = 0, (0, 0)
    for token in tokens:
        kind = tokenize.tok_name.get(token.type, "")
        if kind.endswith("STRING_START"):  # 3.12+ f-strings (3.14 t-strings) arrive in parts: copied whole
            if depth_in_string == 0:
                string_start = token.start
            depth_in_string += 1
            continue
        if depth_in_string:
            if kind.endswith("STRING_END"):
                depth_in_string -= 1
                if depth_in_string == 0:
                    whole = source[starts[string_start[0] - 1] + string_start[1]: starts[token.end[0] - 1]
                                   + token.end[1]]
                    _emit(out, previous, token._replace(string=whole, start=string_start))
                    previous = token
            continue
        string = token.string
        if string in _CLOSERS and brackets:
            droppable, commas = brackets.pop()
            if out and out[-1] == "," and (droppable or commas >= 2):
                out.pop()
                if out and out[-1] == " ":
                    out.pop()
        elif string == "," and brackets:
            brackets[-1][1] += 1
        _emit(out, previous, token)
        if string in _OPENERS:
            called = previous is not None and (previous.string in (")", "]") or previous.type == tokenize.STRING or (
                previous.type == tokenize.NAME and not keyword.iskeyword(previous.string)))
            # A call's or a display's trailing comma is noise; a subscript's or a parenthesis's may make a tuple.
            brackets.append([called if string == "(" else not called, 0])
        previous = token
    return "".join(out)


def _emit(out: list[str], previous: tokenize.TokenInfo | None, token: tokenize.TokenInfo) -> None:
    """Append ``token`` to ``out``, after the space that `normalized` keeps between it and ``previous``."""
    if previous is not None and out:
        string, before = token.string, out[-1]
        tight = before[-1:] in _OPENERS or string in _CLOSERS or string == "," or (
            previous.end[0] != token.start[0] and (string.startswith(".") or before.endswith(".")))
        if not tight and previous.end != token.start:
            out.append(" ")
    out.append(token.string)


def _simple_chain(node: ast.AST) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _parsed_call(frame: FrameType) -> tuple[ast.Call, str] | None:
    """The call expression the frame is executing, parsed from its source (the whole line before 3.11), with the
    text it was parsed from (node positions point into it)."""
    text = call_source(frame)
    if text is None:
        text = source_line(frame)
    text = text.strip()
    try:
        node: Any = ast.parse(text, mode="eval").body
    except SyntaxError:
        try:  # a call over several lines, without the brackets around it that let it span them
            text = f"({text})"
            node = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
    return (node, text) if isinstance(node, ast.Call) else None


def _call_node(frame: FrameType) -> ast.Call | None:
    """The call expression the frame is executing, parsed from its source (the whole line before 3.11)."""
    parsed = _parsed_call(frame)
    return parsed[0] if parsed is not None else None


_calls: dict[int, tuple[CodeType, bool | None]] = {}


def calls_method(frame: FrameType, method: str) -> bool | None:
    """Is the call the frame is executing ``<expr>.<method>(...)``? False when its source reads as a call of another
    method — ours is then called from C, as a key function (``ts.sort(key=torch.Tensor.float)``) — None when the
    source cannot be read or the callee is not an attribute. Cached per call site: asked about discarded results
    only."""
    code = frame.f_code
    key = id(code) + frame.f_lasti
    entry = _calls.get(key)
    if entry is not None and entry[0] is code:
        return entry[1]
    if _readers:
        meet(frame)
    node = _call_node(frame)
    answer: bool | None = None  # unreadable, or a call that may be the method (`getattr(t, m)()`, `f()`)
    if node is not None and isinstance(node.func, ast.Attribute):
        answer = node.func.attr == method
    elif node is not None and isinstance(node.func, ast.Name) and _builtin(frame, node.func.id):
        answer = False  # `any(map(torch.Tensor.bool, ts))`: a builtin calls the method, as a key function would
    trim(_calls, MAX_ANSWERS)
    _calls[key] = (code, answer)
    return answer


def _builtin(frame: FrameType, name: str) -> bool:
    """Whether ``name`` in the frame is a function or type written in C (``any``, ``map``, ``sorted``): a method
    reached from the frame's call of it was called from C. A tensor method under another name (``f = x.float``)
    is no builtin of this kind."""
    value = frame_locals(frame).get(name, frame.f_globals.get(name, _MISSING_NAME))
    if value is _MISSING_NAME:
        value = frame.f_builtins.get(name, _MISSING_NAME)
    return getattr(value, "__module__", None) == "builtins"  # `any`, and types such as `map` or `sorted`'s list


_MISSING_NAME = object()


def callee(frame: FrameType) -> str | None:
    """The source of what the frame is calling (``model`` in ``score = model(x)``), or None."""
    node = _call_node(frame)
    return ast.unparse(node.func) if node is not None else None


def method_call(frame: FrameType, method: str, nargs: int, *, assignable: bool = False,
                limit: int = 100) -> tuple[str | None, str | None]:
    """For a call ``<receiver>.<method>(...)`` at the frame's current instruction, return (receiver, call text).

    The receiver is given only when it is a plain name or attribute chain (``x``, ``self.scale``); a call through
    the class (``torch.Tensor.float(x)``, one more positional argument than ``nargs``) names its first argument.
    With ``assignable``, the receiver is given when a fix can assign the result back to it (`_assignable`: also
    ``batch["img"]`` or ``out[0]`` of a dict or list), and not for an attribute of a tensor. Both are quoted as
    the user wrote them, on one line (`normalized`); a call longer than ``limit`` shows its arguments as ``...``.
    Either is None when the source cannot be read.
    """
    parsed = _parsed_call(frame)
    if parsed is None:
        return None, None
    node, text = parsed
    if not (isinstance(node.func, ast.Attribute) and node.func.attr == method):
        return None, None
    target = node.args[0] if len(node.args) == nargs + 1 else node.func.value
    writable = _assignable(frame, target) if assignable else _simple_chain(target)
    receiver = _segment(text, target) if writable else None
    call = _segment(text, node)
    if len(call) > limit:
        call = f"{_segment(text, node.func)}(...)"
    return receiver, call


def _segment(text: str, node: ast.AST) -> str:
    """The source of ``node`` in ``text``, as `normalized` quotes it."""
    return normalized(ast.get_source_segment(text, node) or ast.unparse(node))


_UNKNOWN = object()


def _assignable(frame: FrameType, node: ast.AST) -> bool:
    """Can ``<node> = <node>.float()`` be written in place of a discarded ``<node>.float()``?

    A name can; so can an attribute of a name or of such a chain (``self.x``, ``out.logits``), unless its object is
    a tensor (``x.T``, ``p.grad``: no variable of the program), it is a module's parameter (``lin.weight``: a module
    takes no plain tensor in its place) or a property of its class (which computes it, or refuses the assignment),
    and an item, by constant or name key, of a dict or list the frame holds (``batch["img"]``, ``outputs[0]``,
    ``xs[i]``): an item of a tensor (``t[0]``) is a view, and assigning to it would copy the result back into the
    tensor's own dtype and device; a tuple takes no item assignment. The objects are read from the frame (its
    variables, ``getattr``, a dict's or list's items), once per message; an attribute whose object cannot be read is
    taken as assignable, an item never is.
    """
    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.Attribute):
        if not _chain(node.value):
            return False  # `make().x`: nothing of the program's holds the call's result
        owner = _value(frame, node.value)
        torch = sys.modules.get("torch")
        if owner is _UNKNOWN or torch is None:
            return True
        if isinstance(owner, torch.Tensor) or isinstance(_value(frame, node), torch.nn.Parameter):
            return False  # `lin.weight = lin.weight.double()`: a module takes no tensor in a parameter's place
        return not isinstance(inspect.getattr_static(type(owner), node.attr, None), property)  # no setter, or code
    if isinstance(node, ast.Subscript):
        if not (_chain(node.value) and _key(frame, node.slice) is not _UNKNOWN):
            return False
        return isinstance(_value(frame, node.value), (MutableMapping, MutableSequence))
    return False


def _chain(node: ast.AST) -> bool:
    """A name, or attributes and constant or name subscripts of one: an expression that reads variables only."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Subscript) and not _plain_key(node.slice):
            return False
        node = node.value
    return isinstance(node, ast.Name)


def _plain_key(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):  # out[-1]
        node = node.operand
    return isinstance(node, (ast.Constant, ast.Name))


def _key(frame: FrameType, node: ast.AST) -> Any:
    if not _plain_key(node):
        return _UNKNOWN
    if isinstance(node, ast.UnaryOp):
        value = _key(frame, node.operand)
        return -value if isinstance(value, (int, float)) else _UNKNOWN
    return node.value if isinstance(node, ast.Constant) else _value(frame, node)


def _value(frame: FrameType, node: ast.AST) -> Any:
    """The object a `_chain` stands for in the frame, or `_UNKNOWN`: names are looked up as Python would (locals,
    globals, builtins); attributes with ``getattr``, as the program's line just did; items only of a plain dict,
    list or tuple, whose lookup runs no code of the program's (a ``defaultdict`` would insert a missing key)."""
    if isinstance(node, ast.Name):
        for scope in (frame_locals(frame), frame.f_globals, getattr(frame, "f_builtins", None)):
            if scope is not None and node.id in scope:
                return scope[node.id]
        return _UNKNOWN
    if isinstance(node, ast.Attribute):
        owner = _value(frame, node.value)
        if owner is _UNKNOWN:
            return _UNKNOWN
        try:
            return getattr(owner, node.attr)
        except Exception:  # a property that fails now: the program's line read it, this is only a message
            return _UNKNOWN
    if isinstance(node, ast.Subscript):
        owner, key = _value(frame, node.value), _key(frame, node.slice)
        if key is _UNKNOWN or type(owner) not in (dict, list, tuple):
            return _UNKNOWN
        try:
            return owner[key]
        except (LookupError, TypeError):
            return _UNKNOWN
    return _UNKNOWN


class Spot:
    """A frame's place (code object, instruction, globals) kept without the frame, for a finding reported later:
    taken in O(1), where the frame's ``f_lineno`` walks its code's line table. It answers what `method_call`,
    `call_source` and `safetorch._report.report_at` read of a frame."""

    __slots__ = ("f_code", "f_lasti", "f_globals")

    def __init__(self, frame: FrameType) -> None:
        self.f_code, self.f_lasti, self.f_globals = frame.f_code, frame.f_lasti, frame.f_globals

    @classmethod
    def at(cls, code: CodeType, lasti: int, module_globals: dict[str, Any]) -> Spot:
        spot = cls.__new__(cls)
        spot.f_code, spot.f_lasti, spot.f_globals = code, lasti, module_globals
        return spot

    @property
    def f_lineno(self) -> int:
        line = 0
        for start, end, number in self.f_code.co_lines():
            if number is not None:
                line = number
            if start <= self.f_lasti < end:
                break
        return line or self.f_code.co_firstlineno


#: The call at a frame's current instruction, parsed (`_parsed_call`), and the object a name or attribute chain of
#: it stands for in the frame (`_value`, `_UNKNOWN` when it cannot be told without running the program's code).
parsed_call = _parsed_call
value_of = _value
