"""ST019: an evaluation (or sampling) loop left in training mode, with autograd on: every forward folds the test
batches into BatchNorm's running statistics (``num_batches_tracked`` counts them), runs with dropout on, and builds a
graph that dies unused. The model the program evaluates next has been changed by its own evaluation.

Which modules: at a looked-at optimizer step (`safetorch._steps`), the modules the ``step()`` line's frame can see
(`safetorch._visible`: ``model``, ``self.model``) that are in training mode, hold BatchNorm with running statistics
or active dropout (`safetorch._modes.train_effects`), and have parameters that optimizer holds: the outermost of them
are *followed*. A followed module keeps a guard in its ``__dict__`` under ``_call_impl``, the same object ST003 puts
there in eval mode (`eval_mode_grad.follow`): it survives ``train()``, stays out of pickles and copies, and steps
aside under ``torch.compile``. Teachers, EMA and momentum copies (MoCo, BYOL) are held by no optimizer: never followed.

What a followed forward costs, in training mode: its guard compares the number of backwards started so far
(`safetorch._backward.count`) with the one it noted at the module's last forward. A forward that follows a backward
(every training step's) stops there. Only a forward with no backward since the module's last one — an evaluation, a
sampler, micro-batches summed into one loss, the second of a Siamese pair — reaches `_forward`: grad mode, the
caller's frame and its site. Top-level calls only (a module called inside another module's forward is never a site);
a second forward at the same line with no backward since the first gets a pre-hook (`_Seen`) on the nodes that
produced its output: a backward or ``torch.autograd.grad`` through them marks the forward used. A weak reference
tells when the graph dies. When `_UNUSED` such forwards at one line, with no backward in between, had their graphs die
without being used, ST019 is reported at that line, once: at the next such forward there (a loop), or, for graphs
that died later (a sampler's chained hidden state, outputs kept in a list), at the next forward of a followed module
that no backward preceded (the training step after the evaluation), the next looked-at step, or the exit summary.

Silent: training forwards (a backward goes through them, or comes between them); summed micro-batches (their graphs
are used); an evaluation under ``no_grad`` or ``inference_mode`` (no graph: this rule is about the loop with neither
``eval()`` nor ``no_grad``); a model in eval mode (ST003's); a model with neither BatchNorm nor dropout (its
evaluation's numbers do not depend on the mode; ST003's memory message is for eval mode only); modules no optimizer
trains; BatchNorm recalibration (every training-mode BatchNorm with ``momentum = None``: the statistics are
recomputed on purpose); outputs whose graph a later loss uses (kept for a contrastive loss, REINFORCE's
log-probabilities).
"""

from __future__ import annotations

import collections
import sys
import weakref
from types import CodeType, FrameType
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.optim import Optimizer

from .. import _backward, _steps, _visible
from .._callsite import callee
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._hooks import untallied
from .._modes import joined, train_effects
from .._patch import Registry
from .._report import before_summary, internal_error, report_at, rule_off, suppressed, user_frame
from .._rule import Rule
from . import eval_mode_grad

CODE = "ST019"
_UNUSED = 1  # forwards at one line whose graphs died unused, no backward in between, before it is reported
_MARKS = 8  # forwards per site whose graph is followed at once (the newest)
_SITES = 4096
_OUTPUT_BUDGET = 64  # objects looked at in a forward's output for its tensors


class EvaluationInTrainModeWarning(SafetorchWarning):
    """ST019: an evaluation loop left in training mode (BatchNorm statistics updated, dropout on, graphs unused)."""

    code = "ST019"


RULE = Rule("ST019", "evaluation-in-train-mode", EvaluationInTrainModeWarning,
            "an evaluation loop in training mode: BatchNorm statistics updated and dropout on, graphs unused")

_is_grad_enabled = torch.is_grad_enabled
_call_impl = torch.nn.Module._call_impl
_getframe = sys._getframe


class _Site:
    """One line that calls one followed module (its first forward's frame: code object and instruction)."""

    __slots__ = ("module", "backwards", "streak", "epoch", "unused", "marks", "state", "filename", "lineno",
                 "globals", "name", "kind")

    NEW, LOOKED, NESTED, DONE = "new", "looked", "nested", "done"

    def __init__(self, module: torch.nn.Module, backwards: int) -> None:
        self.module = weakref.ref(module)
        self.backwards = backwards  # `_backward.count` at its last forward
        self.streak = 0  # forwards here since the last backward, after the first
        self.epoch = 0  # which run of forwards with no backward in between its marks belong to
        self.unused = 0  # forwards of this epoch whose graph died unused
        self.marks: collections.deque[_Mark] = collections.deque(maxlen=_MARKS)
        self.state = _Site.NEW
        self.filename, self.lineno, self.globals = "", 0, {}
        self.name, self.kind = "model", type(module).__name__


class _Mark:
    """One forward's graph, watched: used (a backward went through its output's nodes), or died unused."""

    __slots__ = ("site", "epoch", "used", "ref")

    def __init__(self, site: _Site) -> None:
        self.site = site
        self.epoch = site.epoch
        self.used = False
        self.ref: weakref.ref[_Seen] | None = None

    def died(self, _: Any) -> None:
        """The graph is gone (called by the weak reference, wherever the last node was freed: count, never report)."""
        try:
            site = self.site
            if self.epoch != site.epoch or site.state is _Site.DONE:
                return
            if self.used:
                site.unused = 0
                return
            site.unused += 1
            if site.unused >= _UNUSED and site not in _due:
                _due.append(site)
        except Exception:  # noqa: S110  (interpreter shutdown: nothing left to count for)
            pass


class _Seen:
    """The pre-hook on a watched forward's output nodes; the nodes hold it, so it lives exactly as long as they do."""

    __slots__ = ("mark", "__weakref__")

    def __init__(self, mark: _Mark) -> None:
        self.mark = mark

    def __call__(self, grad_outputs: Any) -> None:
        self.mark.used = True
        return None


_sites: dict[tuple[CodeType, int, int], _Site] = {}
_due: list[_Site] = []  # sites whose count was reached when graphs died outside their own line's forward


def _forward(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A followed module's training-mode forward (called by its guard instead of ``Module._call_impl``)."""
    __tracebackhide__ = True  # noqa: F841
    if _due:
        _flush()
    if not _is_grad_enabled():
        return _call_impl(module, *args, **kwargs)
    caller = _getframe(3)  # this <- the guard <- Module._wrapped_call_impl <- the line that called the module
    key = (caller.f_code, caller.f_lasti, id(module))
    site = _sites.get(key)
    count = _backward.count
    if site is not None and site.backwards == count and site.module() is module:
        return _again(module, site, caller, args, kwargs)
    if site is None or site.module() is not module:
        # No backward since the module's last forward (its guard let it through only then): from a loop at this
        # line, or another line's forward of the same step (a Siamese pair), which the next backward tells apart.
        return _again(module, _new_site(key, module, count), caller, args, kwargs)
    site.backwards = count  # a backward came since this line's last forward: its run of forwards ends here
    if site.streak:
        site.streak = site.unused = 0
        site.epoch += 1
    return _call_impl(module, *args, **kwargs)


def _new_site(key: tuple[CodeType, int, int], module: torch.nn.Module, count: int) -> _Site:
    if len(_sites) >= _SITES:
        for k in [k for k, s in _sites.items() if s.module() is None][: _SITES // 2] or list(_sites)[: _SITES // 2]:
            del _sites[k]
    site = _sites[key] = _Site(module, count)
    return site


def _again(module: torch.nn.Module, site: _Site, caller: FrameType, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Any:
    """A forward at a line that called the module before, with no backward since: an evaluation, a sampler, or
    micro-batches summed into one loss. Watch whether its graph is used."""
    __tracebackhide__ = True  # noqa: F841
    site.streak += 1
    if site.state is _Site.NEW:
        try:
            _place(module, site, caller)
        except Exception as exc:
            site.state = _Site.DONE
            internal_error(CODE, exc)
    if site.state is not _Site.LOOKED or is_compiling() or eval_mode_grad._passthrough():
        return _call_impl(module, *args, **kwargs)
    output = _call_impl(module, *args, **kwargs)
    try:
        _watch(site, output)
    except Exception as exc:
        site.state = _Site.DONE
        internal_error(CODE, exc)
        return output
    if site.unused >= _UNUSED:
        _found(site)  # strict mode raises here, at this line
    return output


def _place(module: torch.nn.Module, site: _Site, caller: FrameType) -> None:
    """Where the site is, and whether it is one: a top-level call at a line of the program's, with ST019 on there."""
    frame = user_frame(caller)
    while frame is not None and frame.f_code.co_name == "__call__" and eval_mode_grad._first_argument(frame) is module:
        frame = user_frame(frame.f_back)  # the class's own __call__ (``super().__call__(x)``): its caller's line
    if frame is None or eval_mode_grad._nested(caller) or eval_mode_grad._in_forward(frame):
        site.state = _Site.NESTED  # a parent's forward calls it: the parent is the site, if it is followed
        return
    site.filename, site.lineno, site.globals = frame.f_code.co_filename, frame.f_lineno, frame.f_globals
    site.name = callee(frame) or "model"
    if suppressed(CODE, site.filename, site.lineno, site.globals) or rule_off(CODE, site.filename, site.lineno,
                                                                               site.globals):
        site.state = _Site.DONE
    else:
        site.state = _Site.LOOKED


def _watch(site: _Site, output: Any) -> None:
    """Hook the nodes that produced the output's tensors (at any depth of a tuple, dict or ``ModelOutput``)."""
    nodes = {t.grad_fn for t in eval_mode_grad._tensors(output, [_OUTPUT_BUDGET]) if t.grad_fn is not None}
    if not nodes:
        return  # no graph left the forward: nothing kept, nothing to tell
    mark = _Mark(site)
    seen = _Seen(mark)
    for node in nodes:
        untallied(node.register_prehook, seen)
    mark.ref = weakref.ref(seen, mark.died)
    site.marks.append(mark)


def _found(site: _Site) -> None:
    __tracebackhide__ = True  # noqa: F841
    module = site.module()
    site.state = _Site.DONE
    site.marks.clear()
    if module is None or not module.training:
        return
    effects = train_effects(module)
    if effects and not _recalibrating(module):  # none: the mode no longer changes what an evaluation computes
        count = site.streak + 1  # the forwards here since the last backward
        report_at(CODE, site.filename, site.lineno, site.globals, lambda: _message(site, effects, count))


def _recalibrating(module: torch.nn.Module) -> bool:
    """Every BatchNorm layer that tracks statistics in training mode has ``momentum = None`` (a cumulative average):
    the loop recomputes the statistics on purpose (after SWA, or after pruning), as ``swa_utils.update_bn`` does."""
    norms = [m for m in module.modules() if isinstance(m, _NormBase) and m.training and m.track_running_stats
             and getattr(m, "running_mean", None) is not None]
    return bool(norms) and all(m.momentum is None for m in norms)


def _flush() -> None:
    """Report the sites whose graphs died unused after their forwards (a sampler's chain, outputs kept in a list)."""
    __tracebackhide__ = True  # noqa: F841
    while _due:
        site = _due.pop()
        if site.state is _Site.LOOKED:
            _found(site)


def _message(site: _Site, effects: list[str], count: int) -> str:
    name = site.name
    statistics = any("BatchNorm" in e for e in effects)
    dropout = any("dropout" in e for e in effects)
    if statistics:
        harm = "The model is changed by its own evaluation" + (", and its results are noisy" if dropout else "")
    else:
        harm = "Its results are noisy"
    return (f"{CODE} {name} ({site.kind}) evaluates in training mode with autograd on: {count} forwards at this line "
            f"with no backward in between built graphs that died unused, while {joined(effects)}. {harm}. Write: "
            f"{name}.eval() and `with torch.no_grad():` around the evaluation, then {name}.train() before training "
            f"resumes")


# --- which modules are followed ------------------------------------------------------------------------------


def _look(optimizer: Optimizer, look: int, caller: FrameType, more: bool) -> None:
    """A looked-at step: follow the outermost training-mode modules with BatchNorm or dropout that the ``step()``
    line's frame can see and whose parameters this optimizer holds."""
    __tracebackhide__ = True  # noqa: F841
    if _due:
        _flush()
    try:
        frame = user_frame(caller)
        if frame is None:
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        candidates: dict[int, torch.nn.Module] = {}
        for _, module in _visible.modules(frame):
            if (id(module) in candidates or not module.training or eval_mode_grad.following(module)
                    or isinstance(module, torch.jit.ScriptModule)):
                continue
            if any(id(p) in held for p in module.parameters()) and train_effects(module):
                candidates[id(module)] = module
        inner = {id(sub) for module in candidates.values() for sub in module.modules() if sub is not module}
        for key, module in candidates.items():
            if key not in inner:
                eval_mode_grad.follow(module, _forward)
    except Exception as exc:
        internal_error(CODE, exc)


def reset() -> None:
    """Forget every site and what is due (tests)."""
    _sites.clear()
    _due.clear()


def _at_exit() -> None:
    """Before the exit summary: what graphs that died late made due, and the graphs still alive that no backward used
    (outputs kept to the end: ``preds = [model(x) for x in loader]``): the program ended, nothing will."""
    if _due:
        _flush()
    for site in list(_sites.values()):
        if site.state is _Site.LOOKED and site.unused < _UNUSED:
            alive = [m for m in site.marks if m.epoch == site.epoch and not m.used and m.ref is not None
                     and m.ref() is not None]
            if alive and site.unused + len(alive) >= _UNUSED:
                _found(site)


def install(registry: Registry) -> None:
    eval_mode_grad.enable(CODE, registry)
    _steps.listen(CODE, _look)
    before_summary(CODE, _at_exit)


def uninstall() -> None:
    _steps.unlisten(CODE)
    before_summary(CODE, None)
    eval_mode_grad.unfollow_all()
    eval_mode_grad.disable(CODE)
    reset()
