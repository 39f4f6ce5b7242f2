"""ST011: gradients accumulate across optimizer steps: ``zero_grad()`` is forgotten, so every ``step()`` uses the sum
of the gradients of all the steps before it.

How it is seen, precisely and cheaply: at a looked-at step (`safetorch._steps`: an optimizer's first steps, then a pair
of consecutive steps every 1024 backwards) the first parameter with a gradient is *watched* until the optimizer's next
step. Eight elements of its gradient are copied, and a tensor hook on the parameter — called by each backward that
reaches it, *before* the gradient is accumulated — checks that the ``.grad`` tensor is still the same object and still
holds exactly the values expected had nothing reset it (the copy, plus what each earlier backward of the interval
added). If that chain holds at every backward of the interval (at least one) up to the next ``step()``, and the
gradient is not all zeros then, nothing reset it between the two steps: the gradient that step uses contains the
previous step's. ST011 at the step line.

What happens *after* the interval's last backward is not compared value for value: clipping
(``clip_grad_norm_``), ``GradScaler.unscale_``, DDP's averaging of the accumulated gradient and a hand-written
``all_reduce`` change every value in place there, but none of them resets anything (torchvision's and timm's
reference loops, cleanrl's PPO: a forgotten ``zero_grad()`` in them is found). A reset shows either at a later
backward (the values no longer follow the chain: ``zero_grad()`` with ``set_to_none`` or not, ``p.grad = None``,
``p.grad.zero_()``, ``p.grad.data.zero_()`` — invisible to version counters, not to values), or at the step (a gradient
set to None, replaced, or all zeros): silent. Correct gradient accumulation (several backwards, one step, then zero)
resets before the interval's first backward: silent, with DDP's ``no_sync()`` too. A GAN's generator backward reaches
the discriminator's parameters after the discriminator's step, but the discriminator's ``zero_grad()`` comes before
its own next backward, which sees the reset: silent. A copy whose eight elements are all zero proves nothing (a reset
would not change it): silent, and so is a chain whose predicted values are all zero at some backward (a GAN's
discriminator loss can cancel the generator's step gradient exactly).

``step(closure)`` (LBFGS): the closure is called several times within one step and must compute fresh gradients each
time. Its calls are watched the same way: when the first backward of a call finds the gradient still holding what
the previous call of that step left (non-zero, same tensor), the closure forgot ``zero_grad()``: ST011 at the
``step(closure)`` line. A closure called once per step (Lightning's automatic optimisation, which accumulates over
batches through it on purpose) is never judged.

Cost: nothing on the steps not looked at; on a watched interval a few 8-element tensor operations. The decision, a
bool on the gradient's device, is read through `safetorch._deferred`: on an accelerator it never makes the host wait
(the finding comes at a later backward, at the step's line). A watch and its finalizer are gone once its interval
ends: nothing kept grows with the number of steps, and the watched parameter is left as torch found it
(`safetorch._hooks.LeafHook`: an empty hook dict would make every later backward pay for torch's hook runner).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.optim import Optimizer

from .. import _deferred, _steps
from .._callsite import Spot, method_call
from .._exceptions import SafetorchWarning
from .._hooks import LeafHook, settle
from .._patch import Registry
from .._report import internal_error, report_at, user_frame
from .._rule import Rule

CODE = "ST011"
_K = 8  # elements compared
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class GradientsAccumulateWarning(SafetorchWarning):
    """ST011: an optimizer step uses gradients accumulated over earlier steps (``zero_grad()`` forgotten)."""

    code = "ST011"


RULE = Rule("ST011", "gradients-accumulate-across-steps", GradientsAccumulateWarning,
            "gradients accumulate across optimizer steps (zero_grad() forgotten)", sampled=True)


@dataclass
class _Watch:
    step: int
    param: weakref.ref[torch.Tensor]
    grad: weakref.ref[torch.Tensor]
    expected: torch.Tensor  # what the first _K elements of .grad hold if nothing reset them
    ok: torch.Tensor  # a bool tensor on the gradient's device: the chain holds so far
    fired: int = 0
    broken: bool = False
    handle: Any = field(default=None, repr=False)
    finalizer: Any = field(default=None, repr=False)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.finalizer is not None:
            self.finalizer.detach()  # else it keeps the watch (and its tensors) alive as long as the optimizer
            self.finalizer = None


_watches: weakref.WeakKeyDictionary[Optimizer, _Watch] = weakref.WeakKeyDictionary()


def _head(t: torch.Tensor) -> torch.Tensor | None:
    """The first _K elements, or None when they cannot be read without a copy (or are not all here: a tensor
    subclass such as FSDP2's DTensor)."""
    if type(t) not in _PLAIN or t.layout is not torch.strided or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.detach().view(-1)[:_K]


def _on_backward(watch: _Watch, incoming: torch.Tensor) -> None:
    """A backward reached the watched parameter; its gradient is not accumulated yet."""
    try:
        param, grad = watch.param(), watch.grad()
        if watch.broken or param is None:
            return
        if grad is None or param.grad is not grad:  # set to None, or replaced since the step
            watch.broken = True
            return
        now, add = _head(grad), _head(incoming)
        if now is None or add is None or add.shape != now.shape or add.dtype != now.dtype:
            watch.broken = True
            return
        # Equal to what nothing-reset predicts, and that prediction is not all zeros (which a reset would also give:
        # a backward can cancel the step's gradient exactly, as a GAN's two losses do).
        watch.ok = watch.ok & (now == watch.expected).all() & watch.expected.ne(0).any()
        watch.expected = watch.expected + add
        watch.fired += 1
    except Exception as exc:
        watch.broken = True
        internal_error(CODE, exc)


def _start(optimizer: Optimizer, step: int) -> None:
    """Watch the first parameter whose gradient can be read without a copy (a channels-last one cannot)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None or not p.requires_grad or g.requires_grad:
                continue
            head = _head(g)
            if head is None:
                continue
            snapshot = head.clone()
            watch = _Watch(step, weakref.ref(p), weakref.ref(g), snapshot, snapshot.ne(0).any())

            watch.handle = LeafHook(p, lambda incoming, watch=watch: _on_backward(watch, incoming))
            _watches[optimizer] = watch
            # an optimizer dropped mid-interval takes its hook with it
            watch.finalizer = weakref.finalize(optimizer, watch.stop)
            return


def _stale(watch: _Watch) -> torch.Tensor | None:
    """At the step after the watched one: a bool tensor, on the gradient's device, True when the gradient still
    carries the watched step's values; None when it is known not to. After the last backward of the interval the
    values may have been scaled or averaged in place (clipping, unscaling, DDP): only a gradient that is all zeros
    then was reset."""
    param, grad = watch.param(), watch.grad()
    if watch.broken or not watch.fired or param is None or grad is None or param.grad is not grad:
        return None
    now = _head(grad)
    return None if now is None else watch.ok & now.ne(0).any()


def _decided(stale: Any, spot: Spot) -> None:
    """The device has computed the decision (at once on the CPU)."""
    if stale:
        name = method_call(spot, "step", 0)[0] or "optimizer"
        report_at(CODE, spot.f_code.co_filename, spot.f_lineno, spot.f_globals, lambda: _message(name))


def _message(name: str) -> str:
    return (f"{CODE} {name}.step() uses the sum of the gradients of every step so far: nothing reset them since the "
            f"last {name}.step() (a watched parameter's .grad still held that step's values when the next backward() "
            f"added to it). Call {name}.zero_grad() once per step: before loss.backward(), or right after "
            f"{name}.step() (to accumulate over several batches on purpose, zero after each step)")


def _look(optimizer: Optimizer, step: int, caller: FrameType, more: bool) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        watch = _watches.pop(optimizer, None)
        if watch is not None:
            watch.stop()
            stale = _stale(watch) if watch.step == step - 1 else None
            frame = user_frame(caller) if stale is not None else None
            if frame is not None:
                _deferred.check(stale, _decided, Spot(frame), CODE)
        settle()
        if more:  # only when the next step is looked at too: a watch (and its hook) never outlives one step interval
            _start(optimizer, step)
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


class _ClosureWatch:
    """The calls of one ``step(closure)``'s closure: after each call, the watched gradient's head; at the first
    backward of the next call, whether the gradient still holds it (nothing reset it in between)."""

    __slots__ = ("closure", "spot", "optimizer", "param", "grad", "left", "handle", "first", "decided")

    def __init__(self, optimizer: Optimizer, closure: Callable[[], Any], spot: Spot) -> None:
        self.closure, self.spot, self.optimizer = closure, spot, weakref.ref(optimizer)
        self.param: weakref.ref[torch.Tensor] | None = None
        self.grad: weakref.ref[torch.Tensor] | None = None
        self.left: torch.Tensor | None = None
        self.handle: Any = None
        self.first = True
        self.decided = False

    def __call__(self) -> Any:
        self._arm()
        try:
            return self.closure()
        finally:
            self._stop()
            settle()  # the closure has returned: no backward of it runs
            self._remember()

    def _arm(self) -> None:
        param = self.param() if self.param is not None else None
        if self.decided or param is None or self.left is None:
            return
        self.first = True

        self.handle = LeafHook(param, lambda _incoming, watch=self: watch._on_backward())

    def _on_backward(self) -> None:
        try:
            if not self.first or self.decided:
                return
            self.first = False
            param, grad = self.param() if self.param else None, self.grad() if self.grad else None
            if param is None or grad is None or param.grad is not grad or self.left is None:
                return
            now = _head(grad)
            if now is None or now.shape != self.left.shape:
                return
            self.decided = True
            _deferred.check((now == self.left).all() & self.left.ne(0).any(), _closure_decided, self.spot, CODE)
        except Exception as exc:
            internal_error(CODE, exc)

    def _stop(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _remember(self) -> None:
        """After a call: the head of the first parameter's gradient, as the closure left it."""
        optimizer = self.optimizer()
        self.left = None
        if optimizer is None or self.decided:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or not p.requires_grad or g.requires_grad:
                    continue
                head = _head(g)
                if head is None:
                    continue
                self.param, self.grad, self.left = weakref.ref(p), weakref.ref(g), head.clone()
                return


def _closure_decided(stale: Any, spot: Spot) -> None:
    if stale:
        name = method_call(spot, "step", 1)[0] or "optimizer"  # step(closure): one argument
        report_at(CODE, spot.f_code.co_filename, spot.f_lineno, spot.f_globals, lambda: _closure_message(name))


def _closure_message(name: str) -> str:
    return (f"{CODE} the closure passed to {name}.step(closure) does not reset the gradients: {name}.step() calls it "
            f"several times, and each call's backward() added to the gradients the previous call left, so every "
            f"evaluation after the first sees the sum of all of them. Call {name}.zero_grad() first thing in the "
            f"closure, before loss.backward()")


def _wrap(optimizer: Optimizer, closure: Callable[[], Any], caller: FrameType) -> Callable[[], Any]:
    frame = user_frame(caller)
    return closure if frame is None else _ClosureWatch(optimizer, closure, Spot(frame))


def install(registry: Registry) -> None:
    _steps.listen(CODE, _look, closure=_wrap)


def uninstall() -> None:
    _steps.unlisten(CODE)
    _deferred.clear(CODE)
    for watch in list(_watches.values()):
        watch.stop()
    _watches.clear()
    settle()
