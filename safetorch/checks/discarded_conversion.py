"""ST001: the result of an out-of-place tensor conversion is discarded (``tensor.cuda()`` as a statement).

``Module.cuda()`` moves a module in place; ``Tensor.cuda()`` returns a copy and leaves the tensor where it was.
Each method is replaced by a `safetorch._patch.MethodPatch` (one object per method, equal to torch's): it calls
torch first, unguarded, then asks the call-site reader whether the caller throws the result away (the next
instruction is POP_TOP): one cached dict lookup per call. Only ``torch.Tensor`` is patched, so
``nn.Module`` methods are never touched; tensor subclasses (``nn.Parameter``) inherit the check.

The shape methods (`SHAPES`) are what a model's forward calls hundreds of times a step, always using the result, and
torch calls the conversions itself (``clip_grad_norm_``'s ``.to()``, one per parameter). On Python 3.12+ both stay
torch's own: `safetorch._monitor` finds the calls whose result the bytecode pops, once per code object, and calls
`_at_site` there only: before torch runs a shape call, after a conversion has returned. On 3.10 and 3.11
`safetorch._discards` reads the program's code as it loads, and a method is patched once a statement of the program
throws one of its calls away (a forward's ``view`` then stays torch's own). With no ``sys.monitoring`` tool id free on
3.12+, every one of them is patched.
"""

from __future__ import annotations

import ast
import sys
import weakref
from types import FrameType
from typing import Any

import torch

from .. import _callsite, _discards, _monitor
from .._callsite import MAX_ANSWERS, calls_method, is_discarded, method_call, parsed_call, trim, value_of
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._patch import MethodPatch, Registry
from .._report import internal_error, is_internal, report
from .._rule import Rule
from .._tracebacks import hide_own_frames

CODE = "ST001"


class DiscardedConversionWarning(SafetorchWarning):
    """ST001: the result of an out-of-place tensor conversion was discarded."""

    code = "ST001"


RULE = Rule("ST001", "discarded-conversion", DiscardedConversionWarning,
            "result of an out-of-place tensor conversion discarded")

#: Out-of-place methods whose only effect is their result. Names missing from a torch build are skipped.
METHODS = (
    "cuda", "cpu", "to", "float", "double", "half", "bfloat16", "long", "int", "short", "bool", "byte", "char",
    "type", "detach", "contiguous", "pin_memory", "clone",
    # the same family: pure conversions that return a new tensor
    "type_as", "cfloat", "cdouble", "chalf", "xpu", "mps", "to_dense", "to_sparse",
)
#: The pure shape methods: a new tensor of another shape (a view, or a copy for ``reshape``/``flatten``), the receiver
#: unchanged. (Their in-place forms, ``squeeze_``, ``t_``, ``transpose_``, change the receiver: not these.)
SHAPES = ("view", "reshape", "permute", "transpose", "squeeze", "unsqueeze", "flatten", "t", "expand")

_is_compiling = is_compiling


def _message(frame: FrameType, method: str, nargs: int, itself: bool = False) -> str:
    """The fix assigns the result back to what the program converted (``x``, ``self.x``, ``batch["img"]``), the line
    a user pastes in place of theirs. Where nothing of the program's can take it (``make().float()``, ``t[0]`` of a
    tensor, an item of a tuple), it says so, with ``<name>`` as a visible placeholder rather than a made-up
    variable that reads as one of theirs. ``itself``: the call returned its receiver (``.cpu()`` of a CPU tensor,
    ``.float()`` of a float one): the line does nothing here, and throws a copy away where the tensor differs."""
    if itself:
        return _itself_message(frame, method, nargs)
    shape = method in SHAPES
    what = ("returns a new tensor of the new shape" if shape else
            "returns a new tensor" if method == "detach" else "returns a copy")
    unchanged = "keeps its shape" if shape else "is unchanged"
    receiver, call = method_call(frame, method, nargs, assignable=True)
    if receiver is not None:
        return (f"{CODE} {call} {what} and its result is discarded; {receiver} {unchanged}. "
                f"Write: {receiver} = {call}")
    if call is not None:
        return (f"{CODE} {call} {what} and its result is discarded; the tensor {unchanged}. Assign the result to a "
                f"name and use that: <name> = {call}")
    return (f"{CODE} tensor.{method}() {what} and its result is discarded; the tensor {unchanged}. "
            f"Assign the result to a name and use that: <name> = <tensor>.{method}(...)")


#: For a call that returned its receiver: the tensors on which the method returns a copy instead.
_COPIES_ON = {
    **dict.fromkeys(("cpu", "cuda", "xpu", "mps"), "on another device"),
    **dict.fromkeys(("float", "double", "half", "bfloat16", "long", "int", "short", "bool", "byte", "char", "cfloat",
                     "cdouble", "chalf", "type", "type_as"), "of another dtype"),
    "contiguous": "that is not contiguous",
    "pin_memory": "that is not pinned",
    "to_dense": "that is not dense",
    "to_sparse": "that is not sparse",
}


_ITSELF = " itself and its result is discarded: here the line does nothing"


def _itself_message(frame: FrameType, method: str, nargs: int) -> str:
    on = _COPIES_ON.get(method, "on another device or of another dtype")
    receiver, call = method_call(frame, method, nargs, assignable=True)
    if receiver is not None:
        return (f"{CODE} {call} returned {receiver}{_ITSELF}, but on a tensor {on} it returns a copy and {receiver} "
                f"stays unchanged. Write: {receiver} = {call}")
    fix = call if call is not None else f"<tensor>.{method}(...)"
    call = call if call is not None else f"tensor.{method}()"
    return (f"{CODE} {call} returned the tensor{_ITSELF}, but on a tensor {on} it returns a copy and the tensor stays "
            f"unchanged. Assign the result to a name and use that: <name> = {fix}")


class _Conversion(MethodPatch):
    """``Tensor.<conversion>``: torch's method, then one cached look at whether the caller throws the result away."""

    @staticmethod
    def calling(wrapped: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841
            try:
                result = wrapped(*args, **kwargs) if kwargs else wrapped(*args)
                try:
                    frame = _getframe(1)
                    # The hot path: one cached lookup of a call site whose result is used.
                    code = frame.f_code
                    if _kept.get(frame.f_lasti) is not code:
                        _after_call(frame, name, len(args) - 1, result, args[0] if args else None)
                except Exception as exc:  # strict-mode findings pass through internal_error
                    internal_error(CODE, exc)
                return result
            except BaseException as exc:  # no frame of ours in the traceback of what passes through
                hide_own_frames(exc)
                raise

        return call


def _after_call(frame: FrameType, method: str, nargs: int, result: Any, receiver: Any = None) -> None:
    """A call site not known to use its result; ``receiver`` is the tensor the method was called on. Dynamo handles
    tensor methods itself and never traces this call; the is_compiling() exit is there should it ever do so. A key
    function called from C, ``ts.sort(key=torch.Tensor.float)``, is no discarded call: its source at this line calls
    something else."""
    if not is_discarded(frame):
        trim(_kept, MAX_ANSWERS)
        _kept[frame.f_lasti] = frame.f_code
    elif isinstance(result, torch.Tensor) and _reportable(frame, method):
        itself = result is receiver
        if isinstance(receiver, torch.Tensor):  # the tensor left unconverted, for a crash note (`crash_notes`)
            trim(_unconverted, MAX_ANSWERS)
            _unconverted[(frame.f_code.co_filename, frame.f_lineno)] = weakref.ref(receiver)
        report(CODE, frame, lambda: _message(frame, method, nargs, itself))


_getframe = sys._getframe
_kept = _callsite._kept  # {f_lasti: code} of the call sites known to use their result (filled by `_after_call`)


def install(registry: Registry) -> None:
    methods = {name: getattr(torch.Tensor, name) for name in (*METHODS, *SHAPES) if hasattr(torch.Tensor, name)}
    # 3.12+: a forward's shape calls and torch's own conversions stay torch's methods
    if _monitor.start(CODE, methods, _at_site, after=frozenset(METHODS)):
        return

    def patch(names: frozenset[str]) -> None:
        for name in sorted(names):
            registry.method(torch.Tensor, name, _Conversion, CODE)

    # 3.10, 3.11: each method patched once the program's code throws one of its calls away
    if not _discards.start(CODE, frozenset(methods), patch):
        patch(frozenset(methods))


def uninstall() -> None:
    _monitor.stop()
    _discards.stop()


def _reportable(frame: FrameType, method: str) -> bool:
    """A discarded call of ``method`` that is the program's: not traced by dynamo, not torch's own code, and the line
    calls that method (not a key function called from C: ``ts.sort(key=torch.Tensor.float)``)."""
    return not _is_compiling() and not is_internal(frame.f_code) and calls_method(frame, method) is not False


def _at_site(frame: FrameType, method: str, receiver: Any, itself: bool) -> None:
    """A discarded call found in the bytecode (`safetorch._monitor`): of a shape method before torch runs it (it
    returns a new tensor), of a conversion once it has returned (``itself``: it returned its receiver). What
    `_after_call` decides for a patched method."""
    if isinstance(receiver, torch.Tensor) and _reportable(frame, method):
        nargs = _positional(frame)
        if itself and receiver.requires_grad and receiver.grad_fn is None:
            itself = _returns_itself(frame, method, receiver)  # a copy of a leaf holds it too: the count cannot tell
        if method not in SHAPES:  # the tensor left unconverted, for a crash note (`crash_notes`)
            trim(_unconverted, MAX_ANSWERS)
            _unconverted[(frame.f_code.co_filename, frame.f_lineno)] = weakref.ref(receiver)
        report(CODE, frame, lambda: _message(frame, method, nargs, itself))


#: The dtype each argument-less dtype method converts to.
_DTYPES = {name: getattr(torch, dtype) for name, dtype in (
    ("float", "float32"), ("double", "float64"), ("half", "float16"), ("bfloat16", "bfloat16"), ("long", "int64"),
    ("int", "int32"), ("short", "int16"), ("bool", "bool"), ("byte", "uint8"), ("char", "int8"),
    ("cfloat", "complex64"), ("cdouble", "complex128"), ("chalf", "complex32")) if hasattr(torch, dtype)}


def _returns_itself(frame: FrameType, method: str, receiver: torch.Tensor) -> bool:
    """Whether ``method`` called with no arguments returns ``receiver`` itself, from the receiver alone; False when
    the call has arguments (a copy is the message's safe side: the fix is the same)."""
    parsed = parsed_call(frame)
    if parsed is None or parsed[0].args or parsed[0].keywords:
        return False
    if method in _DTYPES:
        return receiver.dtype == _DTYPES[method]
    if method == "cpu":
        return receiver.device.type == "cpu"
    if method == "contiguous":
        return receiver.is_contiguous()
    return False


def _positional(frame: FrameType) -> int:
    """The call's positional arguments after the tensor, as a patched method counts them (``len(args) - 1``): one
    fewer than written for a call through the class (``torch.Tensor.view(x, 6)``)."""
    parsed = parsed_call(frame)
    if parsed is None:
        return 0
    node = parsed[0]
    through_class = isinstance(node.func, ast.Attribute) and isinstance(value_of(frame, node.func.value), type)
    return len(node.args) - 1 if through_class and node.args else len(node.args)


#: Error messages of device and dtype mismatches, which a discarded conversion typically causes later.
MISMATCH = (
    "Expected all tensors to be on the same device",
    "should be the same",  # Input type (...) and weight type (...) should be the same
    "must have the same dtype",
    "expected scalar type",
    "Expected object of device type",
    "expected m1 and m2 to have the same dtype",
)


#: The tensor each discarded conversion left unconverted (its last, by line): a crash note names the line only when
#: that tensor is an operand of the operation that failed.
_unconverted: dict[tuple[str, int], weakref.ref[torch.Tensor]] = {}


def _operands(exc: BaseException) -> set[int]:
    """The ids of the tensors the failing operation could have been given: those the innermost frame of the
    traceback holds (its locals, one level into lists, tuples and dicts, and the parameters and buffers of a module
    it holds, as ``self`` in ``Linear.forward``)."""
    tb = exc.__traceback__
    if tb is None:
        return set()
    while tb.tb_next is not None:
        tb = tb.tb_next
    found: set[int] = set()
    for value in list(tb.tb_frame.f_locals.values()):
        items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        if isinstance(value, torch.nn.Module):
            items = [*value._parameters.values(), *value._buffers.values()]
        for item in (value, *items[:64]):
            if isinstance(item, torch.Tensor):
                found.add(id(item))
    return found


def crash_notes(exc: BaseException) -> list[str]:
    """For an uncaught device/dtype mismatch: name the earlier discarded conversions of a tensor that the failing
    operation was given, its usual cause (a discarded conversion of another tensor is no cause of this error)."""
    text = str(exc)
    if not isinstance(exc, (RuntimeError, TypeError)) or not any(m in text for m in MISMATCH):
        return []
    from .._report import findings

    operands = _operands(exc)

    from .._notebook import cell_name

    shown = {(cell_name(f) or f, line): ref for (f, line), ref in list(_unconverted.items())}  # `Cell In[5]`

    def operand(site: Any) -> bool:
        ref = shown.get((site.filename, site.lineno))
        tensor = ref() if ref is not None else None
        return tensor is not None and id(tensor) in operands

    # A call that returned the tensor itself left it where it was already: it cannot have caused the mismatch.
    # Nor can a discarded reshape move a tensor or change its dtype.
    sites = [s for s in findings()
             if s.code == CODE and _ITSELF not in s.message and "of the new shape" not in s.message and operand(s)]
    return [f"safetorch: {s.filename}:{s.lineno} discarded a conversion earlier, the usual cause of this error: "
            f"{s.message.removeprefix(CODE).strip()}" for s in sites[-3:]]
