"""ST021: a comparison with NaN (``loss == float("nan")``, ``v is np.nan``, ``torch.eq(x, nan)``): always False.

NaN is equal to nothing, itself included, and ``float("nan")`` makes a new object every time: ``==``, ``is`` and
``torch.eq`` with a NaN never say True (``!=`` always does), so the NaN check the program wrote never fires. Such a
comparison between two Python floats runs no torch code at all: it can be seen only in the program's bytecode. So
this rule reads code objects, never calls: where the call-site reader (`safetorch._callsite`) meets a code object on
one of its slow paths, and at the first backwards of a run (where training code calls ``loss.backward()``), each code
object the program runs there is read once, with the code objects nested in it (its comprehensions, lambdas, inner
functions). A comparison ``==``/``!=``/``is``/``is not`` one of whose operands is a NaN written out —
``float("nan")`` (any case, signed), ``math.nan``, ``np.nan``, ``torch.nan``, a name ``nan``/``NaN``/``NAN`` — and a
call of ``eq``/``ne``/``equal`` given one, is reported at its line, with ``isnan`` of the other operand as the fix.

Silent: ``x != x``, ``math.isnan``/``torch.isnan``/``np.isnan``, comparisons with other floats (``inf`` included),
``is None``, NaN used as a value (``torch.full(..., float("nan"))``, ``np.nan_to_num(x, nan=0.0)``, ``d.get(k,
np.nan)``), and code of torch, wrapt or safetorch.
"""

from __future__ import annotations

import ast
import dis
import sys
from types import CodeType, FrameType, ModuleType
from typing import Any

from .. import _backward, _callsite, _discards
from .._callsite import Spot, call_source, getline, producer_index
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, is_internal, report_at
from .._rule import Rule

CODE = "ST021"


class NanComparisonWarning(SafetorchWarning):
    """ST021: a comparison with NaN, which is always False (``!=``: always True)."""

    code = "ST021"


RULE = Rule("ST021", "nan-comparison", NanComparisonWarning,
            "a comparison with NaN (`x == float(\"nan\")`, `v is np.nan`, `torch.eq(x, nan)`): always False")

#: The names a NaN goes by: ``math.nan``, ``np.nan``/``np.NaN``/``np.NAN``, ``torch.nan``, ``from math import nan``.
NAN_NAMES = frozenset({"nan", "NaN", "NAN"})
_NAN_TEXTS = frozenset({"nan", "+nan", "-nan"})
#: Callables that make a NaN from the text "nan": ``float("nan")``, ``np.float64("nan")``, ``torch.tensor``'s are not.
_FLOATS = frozenset({"float", "float64", "float32", "float16", "double", "single", "float_"})
_EQUALITIES = frozenset({"eq", "ne", "eq_", "ne_", "equal", "__eq__", "__ne__"})
_LOAD_NAME = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW",
                        "LOAD_CLASSDEREF"})
_LOAD_ATTR = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_CALLS = frozenset({"CALL", "CALL_FUNCTION", "CALL_METHOD"})
_SKIP = frozenset({"PRECALL", "PUSH_NULL", "NOP", "EXTENDED_ARG", "CACHE", "KW_NAMES"})

#: The backwards at whose caller the code objects are read: training code calls ``backward()`` from the first step.
BACKWARDS = 64


class _State:
    """The one owner of ST021's state: the code objects read (``id`` → code, the code kept so that its id is not
    reused), and the backwards still to look at."""

    def __init__(self) -> None:
        self.read: dict[int, CodeType] = {}
        self.backwards = BACKWARDS

    def clear(self) -> None:
        self.read.clear()
        self.backwards = BACKWARDS


_state = _State()
MAX_CODES = 1 << 14


def _real(instructions: list[dis.Instruction], j: int) -> int:
    """The index of the nearest instruction at or before ``j`` that does something (PRECALL, PUSH_NULL skipped)."""
    while j >= 0 and instructions[j].opname in _SKIP:
        j -= 1
    return j


def _name_of(ins: dis.Instruction) -> Any:
    return ins.argval[-1] if isinstance(ins.argval, tuple) else ins.argval


_LOCAL = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF", "LOAD_CLASSDEREF"})
_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF"})
_UNBOUND = object()


def _names_a_nan(instructions: list[dis.Instruction], j: int, module_globals: dict[str, Any] | None) -> bool:
    """A load of a name spelled as NaN is NaN written out (``from math import nan``) unless the name is the program's
    own variable: a local (``nan = torch.isnan(loss).item()`` in a function), a name this code object assigns
    something else to (the same line in a script), a global bound to something that is no NaN, or an attribute of
    an object that is not a module (``self.nan``, a flag)."""
    ins = instructions[j]
    name = _name_of(ins)
    if ins.opname in _LOAD_ATTR:
        base = _real(instructions, j - 1)
        owner = instructions[base] if base >= 0 else None
        if owner is not None and owner.opname in _LOCAL:
            return False  # `self.nan`, `stats.nan`: an attribute of a local object
        if owner is not None and owner.opname in _LOAD_NAME and module_globals is not None:
            value = module_globals.get(_name_of(owner), _UNBOUND)
            return value is _UNBOUND or isinstance(value, ModuleType)
        return True
    if ins.opname in _LOCAL:
        return False
    for k, other in enumerate(instructions):
        if other.opname in _STORES and _name_of(other) == name and \
                not _is_nan(instructions, producer_index(instructions, k, 0)) and \
                not _imports_a_nan(instructions, producer_index(instructions, k, 0)):
            return False  # the code assigns it something computed: `nan = torch.isnan(loss).item()`
    value = module_globals.get(name, _UNBOUND) if module_globals is not None else _UNBOUND
    return value is _UNBOUND or (isinstance(value, float) and value != value)


def _imports_a_nan(instructions: list[dis.Instruction], j: int | None) -> bool:
    """``from math import nan`` (``from numpy import NaN``): the store's value is the module's NaN."""
    return j is not None and j >= 0 and instructions[j].opname == "IMPORT_FROM" and \
        _name_of(instructions[j]) in NAN_NAMES


def _sentinel(instructions: list[dis.Instruction], j: int | None) -> bool:
    """Is the instruction at ``j`` a load of a name that this code object assigns a NaN written out to (``best =
    np.nan``, a "no value yet" sentinel)? Compared with ``is``, it is the very object: the check works."""
    if j is None or j < 0 or instructions[j].opname not in _LOAD_NAME:
        return False
    name = _name_of(instructions[j])
    return any(other.opname in _STORES and _name_of(other) == name and
               _is_nan(instructions, producer_index(instructions, k, 0)) for k, other in enumerate(instructions))


def _is_nan(instructions: list[dis.Instruction], j: int | None,
            module_globals: dict[str, Any] | None = None) -> bool:
    """Does the instruction at ``j`` push a NaN written out in the source?"""
    if j is None or j < 0:
        return False
    ins = instructions[j]
    if ins.opname in _LOAD_ATTR or ins.opname in _LOAD_NAME:
        return _name_of(ins) in NAN_NAMES and _names_a_nan(instructions, j, module_globals)
    if ins.opname in _CALLS and ins.arg == 1:
        k = _real(instructions, j - 1)
        const = instructions[k] if k >= 0 else None
        if const is None or const.opname != "LOAD_CONST" or not isinstance(const.argval, str) or \
                const.argval.strip().lower() not in _NAN_TEXTS:
            return False
        k = _real(instructions, k - 1)
        callee = instructions[k] if k >= 0 else None
        return callee is not None and (callee.opname in _LOAD_NAME or callee.opname in _LOAD_ATTR) and \
            _name_of(callee) in _FLOATS
    return False


def _comparison(ins: dis.Instruction) -> str | None:
    """``==``, ``!=``, ``is`` or ``is not`` for a comparison instruction, else None."""
    if ins.opname == "COMPARE_OP":
        shown = str(ins.argrepr)
        return "==" if "==" in shown else "!=" if "!=" in shown else None
    if ins.opname == "IS_OP":
        return "is not" if ins.arg else "is"
    return None


def scan(code: CodeType, module_globals: dict[str, Any] | None = None) -> list[tuple[int, str]]:
    """The comparisons with a NaN in ``code`` (not its nested code objects): (instruction offset, operator).
    ``module_globals``: the code's module namespace, where a global name spelled as NaN is looked up."""
    instructions = _callsite.instructions(code)
    found: list[tuple[int, str]] = []
    for i, ins in enumerate(instructions):
        op = _comparison(ins)
        if op is not None:
            right, left = producer_index(instructions, i, 0), producer_index(instructions, i, 1)
            for nan, other in ((right, left), (left, right)):
                if _is_nan(instructions, nan, module_globals):
                    if not (op.startswith("is") and _sentinel(instructions, other)):
                        found.append((ins.offset, op))
                    break
        elif ins.opname in _CALLS and ins.arg:
            start = i - 1 if instructions[i - 1].opname == "PRECALL" else i
            callee = producer_index(instructions, start, ins.arg)
            if callee is not None and instructions[callee].opname == "PUSH_NULL":
                # 3.13+: a module's function (`torch.eq`, the module imported in this file) is a plain attribute
                # load with the NULL pushed after it, below the arguments, not before it as on 3.11 and 3.12
                callee = producer_index(instructions, start, ins.arg + 1)
            if callee is not None and instructions[callee].opname in _LOAD_ATTR and \
                    _name_of(instructions[callee]) in _EQUALITIES and \
                    any(_is_nan(instructions, producer_index(instructions, start, d), module_globals)
                        for d in range(ins.arg)):
                found.append((ins.offset, _name_of(instructions[callee])))
    return found


def _codes(code: CodeType) -> list[CodeType]:
    """``code`` and the code objects nested in it (comprehensions, lambdas, inner functions and classes)."""
    out, todo = [], [code]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(k for k in c.co_consts if isinstance(k, CodeType))
    return out


def _read(frame: FrameType) -> None:
    """A frame met by a reader: read its code object, and those nested in it, once each."""
    try:
        code = frame.f_code
        read = _state.read
        if read.get(id(code)) is code or is_internal(code):
            return
        for c in _codes(code):
            if read.get(id(c)) is c:
                continue
            if len(read) > MAX_CODES:
                read.clear()
            read[id(c)] = c
            for offset, op in scan(c, frame.f_globals):
                spot = Spot.at(c, offset, frame.f_globals)
                report_at(CODE, c.co_filename, spot.f_lineno, frame.f_globals,
                          lambda s=spot, o=op: _message(s, o))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _on_backward(tensors: Any) -> None:
    """At the first backwards: read the code object that called ``backward()`` (and the one around it)."""
    try:
        _state.backwards -= 1
        if _state.backwards <= 0:
            _backward.unlisten(CODE)  # the backward iterates over a tuple of listeners: leaving it now is safe
        caller = _backward.caller()
        frame = _backward.origin(caller)[0] if caller is not None else None
        if frame is not None:
            _read(frame)
            if frame.f_back is not None and not is_internal(frame.f_back.f_code):
                _read(frame.f_back)
    except Exception as exc:
        internal_error(CODE, exc)


# -- the message ------------------------------------------------------------------------------------------------


def _source(spot: Spot) -> str:
    """The comparison's (or the call's) source: its span from 3.11, else the stripped line."""
    text = call_source(spot)  # type: ignore[arg-type]
    return text.strip() if text else getline(spot.f_code.co_filename, spot.f_lineno, spot.f_globals).strip()


def _parse(text: str) -> tuple[ast.AST, str] | None:
    """The expression ``text`` holds, and the text it was parsed from (a line's ``if``/``while``/... taken off)."""
    words = text.split(None, 1)  # none where the source is unknown (``python -c``, code compiled from a string)
    keyword = len(words) == 2 and words[0] in ("if", "elif", "while", "assert", "return")
    for candidate in (text, text.rstrip(":") if text.endswith(":") else None,
                      words[1].rstrip(":") if keyword else None):
        if not candidate:
            continue
        try:
            return ast.parse(candidate.strip(), mode="eval").body, candidate.strip()
        except SyntaxError:
            continue
    if not words:
        return None
    try:  # a statement: ``kept = [v for v in xs if v != nan]``
        return ast.parse(text.strip(), mode="exec"), text.strip()
    except SyntaxError:
        return None


def _nan_node(node: ast.AST) -> str | None:
    """The module a NaN node is spelled with (``"torch"``, ``"np"``, ``"math"``, ``""``), or None for no NaN."""
    if isinstance(node, ast.Attribute) and node.attr in NAN_NAMES:
        base = node.value
        return base.id if isinstance(base, ast.Name) else ""
    if isinstance(node, ast.Name) and node.id in NAN_NAMES:
        return ""
    if isinstance(node, ast.Call) and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and \
            isinstance(node.args[0].value, str) and node.args[0].value.strip().lower() in _NAN_TEXTS:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in _FLOATS:
            return func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
    return None


def _find(tree: ast.AST, op: str) -> tuple[ast.AST, str, bool, ast.AST] | None:
    """In ``tree``: (the operand compared with NaN, the NaN's module, negated, the comparison or call) for ``op``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = node.left, node.comparators[0]
            negated = isinstance(node.ops[0], (ast.NotEq, ast.IsNot))
            for nan, other in ((right, left), (left, right)):
                module = _nan_node(nan)
                if module is not None and _nan_node(other) is None:
                    return other, module, negated, node
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _EQUALITIES:
            args = [*node.args]
            if len(args) == 1:
                args.insert(0, node.func.value)  # x.eq(nan): the receiver is the operand
            module = next((m for m in map(_nan_node, args) if m is not None), None)
            others = [a for a in args if _nan_node(a) is None]
            if module is not None and others:
                receiver = node.func.value
                spelled = receiver.id if isinstance(receiver, ast.Name) and len(node.args) == 2 else module
                return others[0], spelled, node.func.attr.startswith(("ne", "__ne")), node
    return None


def _isnan(operand: ast.AST, module: str, spot: Spot) -> str:
    """``torch.isnan(x)``, ``np.isnan(x)`` or ``math.isnan(v)``: by the operand's value where the frame holds it,
    else by how the NaN (or the call) was spelled; a Python number (``.item()``) takes ``math.isnan``."""
    text = ast.unparse(operand)
    value = _value(operand, spot)
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        kind = "torch"
    elif np is not None and isinstance(value, np.ndarray):
        kind = module if module in ("np", "numpy") else "np"
    elif isinstance(value, (int, float)) or text.endswith(".item()"):
        kind = "math"
    elif module in ("torch", "np", "numpy"):
        kind = module
    else:
        kind = "math"
    return f"{kind}.isnan({text})"


def _value(node: ast.AST, spot: Spot) -> Any:
    if isinstance(node, ast.Name):
        frame = sys._getframe()
        while frame is not None and frame.f_code is not spot.f_code:
            frame = frame.f_back  # type: ignore[assignment]
        scope = _callsite.frame_locals(frame) if frame is not None else {}
        return scope[node.id] if node.id in scope else spot.f_globals.get(node.id)
    return None


def _message(spot: Spot, op: str) -> str:
    text = _source(spot)
    parsed = _parse(text)
    found = _find(parsed[0], op) if parsed is not None else None
    if found is not None and parsed is not None and sys.version_info < (3, 11):  # the line, not the comparison's span
        text = ast.get_source_segment(parsed[1], found[3]) or text
    always = "True" if op in ("!=", "is not", "ne", "ne_", "__ne__") else "False"
    shown = f"`{_callsite.normalized(text)}`" if text and len(text) <= 100 else "this comparison" if text else \
        "this line"  # its source unknown: ``python -c``, code compiled from a string
    if found is None:
        return (f"{CODE} {shown} compares with NaN: always {always}, since NaN equals nothing, itself included, so "
                f"this NaN check never fires. Write: torch.isnan(x) for a tensor, math.isnan(v) for a number")
    operand, module, negated, _ = found
    fix = _isnan(operand, module, spot)
    if negated:
        fix = f"~{fix}" if fix.startswith("torch.") else f"not {fix}"
    if op.startswith("is"):
        return (f"{CODE} {shown} is {always} for every NaN a computation makes: `{op}` asks whether it is the very "
                f"object written here, so this NaN check never fires. Write: {fix}")
    return (f"{CODE} {shown} is always {always}: NaN equals nothing, itself included, so this NaN check never fires. "
            f"Write: {fix}")


def _may_compare_with_nan(code: CodeType) -> bool:
    """Whether ``code`` names a NaN (``float("nan")``, ``math.nan``, ``np.nan``): on 3.10 and 3.11 the methods it
    calls are then patched, whose first call at a site meets it (`safetorch._discards`). Asked whether or not ST021
    is on yet: ST001 reads the program's code at its install, which may come first."""
    return any(isinstance(c, str) and c.lower() == "nan" for c in (*code.co_names, *code.co_consts))


# Registered when this module is imported, before ST001 reads the program's code at its install.
_discards.meet_while_running(CODE, _may_compare_with_nan)


def install(registry: Registry) -> None:
    _callsite.on_new_code(CODE, _read)
    _state.backwards = BACKWARDS
    _backward.listen(CODE, before=_on_backward)


def uninstall() -> None:
    _callsite.on_new_code(CODE, None)
    _backward.unlisten(CODE)
    _state.clear()
