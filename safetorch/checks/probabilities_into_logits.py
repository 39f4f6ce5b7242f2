"""ST009: probabilities fed to a loss that wants logits (or log-probabilities).

``cross_entropy`` applies ``log_softmax`` itself and ``binary_cross_entropy_with_logits`` applies ``sigmoid``
itself; given ``softmax``/``sigmoid`` output they compute the loss of squashed scores, whose gradients almost vanish:
the model trains slowly or not at all, and nothing fails. ``nll_loss`` wants log-probabilities: ``softmax`` output
(not ``log_softmax``) or a ``log_softmax`` over another dimension than the classes' are the same mistake.

Seen from the input's autograd graph: ``input.grad_fn``, followed up to a few shape-only nodes (view, reshape,
permute, transpose, clone, a dtype or device copy, squeeze, slicing), is ``SoftmaxBackward0`` /
``SigmoidBackward0``. Nothing is wrapped: the three functional losses (which ``nn.CrossEntropyLoss`` & co. call)
each call ``torch.nn._reduction.get_enum``, whose replacement (`safetorch._losses`, shared with ST002) reads the
``input`` of those three by their code objects — no frame between the user and the loss. The first 32 loss
calls are looked at, then one in 64 on average, at varying intervals (`safetorch._losses`: looks are at most 127
loss calls apart, and a loss computed with autograd off is not read). Silent: raw logits,
``log_softmax(dim=1)``, ``torch.log(probs)`` into ``nll_loss``, softmaxed *targets* (distillation, label smoothing:
only the input is looked at), and any loss computed under ``no_grad`` (validation: the training loop, which has the
same line or the same mistake, is where it is reported).

Where it is reported: at the loss's line, unless the function that calls the loss has no ``softmax``/``sigmoid`` of
its own and the models it holds (its variables, ``self``) have exactly one line in their ``forward`` that calls one
(``return F.softmax(out, dim=1)``): the model returns probabilities, and that line is the one to change.
"""

from __future__ import annotations

import ast
import inspect
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F

from .. import _callsite, _losses
from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, is_internal, report, report_at, user_frame
from .._rule import Rule

CODE = "ST009"


class ProbabilitiesIntoLogitsLossWarning(SafetorchWarning):
    """ST009: softmax/sigmoid output fed to a loss that applies log_softmax/sigmoid itself (or softmax into
    ``nll_loss``)."""

    code = "ST009"


RULE = Rule("ST009", "probabilities-into-logits-loss", ProbabilitiesIntoLogitsLossWarning,
            "softmax/sigmoid output fed to a loss that expects logits (or softmax into nll_loss)")

#: Nodes that only move or reshape values: the probabilities stay probabilities through them.
_SHAPE_ONLY = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "PermuteBackward0", "TransposeBackward0",
    "TransposeBackward1", "TBackward0", "CloneBackward0", "ToCopyBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "SqueezeBackward3", "SqueezeBackward4", "UnsqueezeBackward0", "SliceBackward0",
    "SelectBackward0", "ExpandBackward0", "AliasBackward0",
    # one part of a split: `for out in softmax(...)` iterates by unbind; chunk() and split() give their pieces
    "UnbindBackward0", "SplitBackward0", "SplitWithSizesBackward0",
})
_HOPS = 4
_WANTS = {"cross_entropy": "SoftmaxBackward0", "nll_loss": "SoftmaxBackward0",
          "binary_cross_entropy_with_logits": "SigmoidBackward0"}


def _producer(t: torch.Tensor) -> tuple[Any, int]:
    """(the first node above ``t`` that is not shape-only, how many shape-only nodes were passed), or (None, 0)."""
    fn = t.grad_fn
    for hops in range(_HOPS + 1):
        if fn is None:
            return None, 0
        if fn.name() not in _SHAPE_ONLY:
            return fn, hops
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return None, 0


def _signed(dim: int) -> int:
    return dim - (1 << 64) if dim >= 1 << 63 else dim  # torch shows a saved negative dim as unsigned


def _argument(frame: FrameType) -> str:
    node = _callsite._call_node(frame)
    if node is not None and node.args:
        text = ast.unparse(node.args[0])
        if len(text) <= 60:
            return f"`{text}`"
    return "its input"


def _message(loss: str, kind: str, frame: FrameType, dim: int = 0) -> str:
    given = _argument(frame)
    if kind == "SigmoidBackward0":
        return (f"{CODE} {loss}() got {given}, the output of sigmoid(): it applies sigmoid itself, so it computes "
                f"the loss of sigmoid(sigmoid(x)), whose gradients almost vanish: training stalls. Pass the logits, "
                f"the input of sigmoid() (or keep sigmoid() and use binary_cross_entropy)")
    if kind == "LogSoftmaxBackward0":
        return (f"{CODE} {loss}() got {given}, a log_softmax over dim={dim}, but its classes are on dim=1: the loss "
                f"compares the wrong values. Write log_softmax(logits, dim=1)")
    if loss == "nll_loss":
        return (f"{CODE} nll_loss() got {given}, the output of softmax(): nll_loss wants log-probabilities, and with "
                f"probabilities it computes -p instead of -log(p). Write log_softmax(logits, dim=1) (or "
                f"cross_entropy(logits, target), which is both)")
    return (f"{CODE} {loss}() got {given}, the output of softmax(): it applies log_softmax itself, so it computes "
            f"log_softmax(softmax(x)), whose gradients almost vanish: training stalls. Pass the logits, the "
            f"input of softmax() (keep softmax() for reading probabilities)")


def _look(loss: str) -> Any:
    def look(frame: FrameType) -> None:
        """``frame`` is the functional loss's own, calling ``get_enum``: its ``input`` is what the user passed."""
        __tracebackhide__ = True  # noqa: F841
        try:
            _check(loss, frame.f_locals.get("input"), frame)
        except Exception as exc:  # strict-mode findings pass through internal_error
            internal_error(CODE, exc)

    return look


def _check(loss: str, input: Any, loss_frame: FrameType) -> None:
    __tracebackhide__ = True  # noqa: F841
    if not isinstance(input, torch.Tensor) or input.grad_fn is None:
        return
    fn, hops = _producer(input)
    if fn is None:
        return
    kind = fn.name()
    dim = 0
    if kind == "LogSoftmaxBackward0" and loss == "nll_loss" and hops == 0 and input.dim() >= 2:
        dim = _signed(fn._saved_dim)
        if dim % input.dim() == 1:
            return
    elif kind != _WANTS[loss]:
        return
    frame = user_frame(loss_frame.f_back)
    if frame is None:
        return
    origin = _in_forward(frame, kind) if kind in ("SoftmaxBackward0", "SigmoidBackward0") else None
    if origin is None:
        report(CODE, frame, lambda: _message(loss, kind, frame, dim))
        return
    code, line, module_globals, owner = origin
    where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
    squash = "sigmoid" if kind == "SigmoidBackward0" else "softmax"
    report_at(CODE, code.co_filename, line, module_globals, lambda: (
        f"{_message(loss, kind, frame, dim)}. Here {owner}.forward returns the output of {squash}(), which "
        f"{loss}() at {where} is given: return the logits from forward, and apply {squash}() where probabilities "
        f"are read"))


_NAME_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF",
                         "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_FAST_LOAD_FAST", "LOAD_SUPER_ATTR"})
#: Modules of the caller's models read for the line that applies softmax: a bound on a very large model.
MAX_MODULES = 4096


def _loads(code: Any, name: str) -> list[int]:
    """The lines of ``code`` that load ``name`` (``F.softmax``, ``x.softmax``, ``self.softmax``, ``softmax``)."""
    lines = []
    for ins in _callsite.instructions(code):
        if ins.opname in _NAME_LOADS and (name in ins.argval if isinstance(ins.argval, tuple) else ins.argval == name):
            spot = _callsite.Spot.at(code, ins.offset, {})
            lines.append(spot.f_lineno)
    return lines


def _in_forward(frame: FrameType, kind: str) -> tuple[Any, int, dict[str, Any], str] | None:
    """(code, line, globals, class name) of the one ``forward`` line among the caller's models that applies the
    squashing function, when the caller applies none itself; else None."""
    name = "sigmoid" if kind == "SigmoidBackward0" else "softmax"
    if _loads(frame.f_code, name):
        return None
    found: dict[tuple[Any, int], tuple[dict[str, Any], str]] = {}
    seen: set[Any] = set()
    count = 0
    for value in list(_callsite.frame_locals(frame).values()):
        if not isinstance(value, torch.nn.Module):
            continue
        for module in value.modules():
            count += 1
            if count > MAX_MODULES:
                return None
            forward = getattr(type(module), "forward", None)
            code = getattr(forward, "__code__", None)
            if code is None or code in seen or is_internal(code):
                continue
            seen.add(code)
            for line in _loads(code, name):
                found[(code, line)] = (getattr(forward, "__globals__", {}), type(module).__qualname__)
    if len(found) != 1:
        return None
    (code, line), (module_globals, owner) = next(iter(found.items()))
    return code, line, module_globals, owner


def install(registry: Registry) -> None:
    _losses.listen(CODE, looks={inspect.unwrap(getattr(F, loss)).__code__: _look(loss) for loss in _WANTS})


def uninstall() -> None:
    _losses.unlisten(CODE)
