"""ST013: ``F.dropout(x, p)`` in the forward of a module in eval mode: ``training`` defaults to True, so dropout
stays on after ``model.eval()`` and every evaluation is noisy (and lower than it should be).

``F.dropout``, ``F.dropout1d``/``2d``/``3d`` are replaced by plain functions with torch's signature, while a module
the program put in eval mode (its own ``eval()``) is in it: a training step's ``nn.Dropout`` calls torch's function
untouched (GPT-2's layout called the replacement 74 times a step). A module that is in eval mode without an ``eval()``
of the program's (unpickled so) is not looked at until one. A call that passes
``training`` (positionally or by name) is never looked at further — ``nn.Dropout`` passes ``self.training``, MC dropout
passes ``training=True`` — so a correct program pays one plain call per ``F.dropout`` and nothing else. Without
``training``: when the calling function's first argument is ``self``, an ``nn.Module`` whose ``training`` is False, and
``p`` is not 0 (a number: a tensor ``p`` is not read), ST013 at the ``F.dropout`` line. Silent: calls from torch itself
(``multi_head_attention_forward`` passes ``training``), a helper function without ``self`` (not seen: the rule misses it
rather than guess), and a module in training mode.
``F.alpha_dropout``'s ``training`` defaults to False: it has the opposite mistake, not this one.

``F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout)`` is the same mistake with another spelling
(karpathy/nanoGPT#240): ``dropout_p`` applies whatever the module's mode. Its replacement looks only at a call with
a ``dropout_p`` that is not 0 (a training forward's, or this mistake), under the same conditions; torch's builtin is
called as it was, the replacement is known to TorchScript as the same builtin, and under ``torch.compile`` it only
calls torch's function.
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any

import torch.nn as nn
import torch.nn.functional as F

from .._callsite import quoted_call
from .._compat import is_compiling
from .._exceptions import SafetorchWarning
from .._patch import Registry, with_globals_of
from .._report import internal_error, is_internal, report
from .._rule import Rule
from .._tracebacks import hide_own_frames
from . import eval_mode_grad

CODE = "ST013"


class FunctionalDropoutInEvalWarning(SafetorchWarning):
    """ST013: ``F.dropout`` without ``training=`` in the forward of an eval-mode module: dropout stays on."""

    code = "ST013"


RULE = Rule("ST013", "functional-dropout-in-eval", FunctionalDropoutInEvalWarning,
            "F.dropout without training= in the forward of an eval-mode module")

_FUNCTIONS = ("dropout", "dropout1d", "dropout2d", "dropout3d")


def _message(function: str, module: nn.Module, shown: str, method: str) -> str:
    return (f"{CODE} {shown} in {type(module).__name__}.{method}() keeps dropping after .eval(): F.{function}'s "
            f"training= defaults to True whatever the module's mode, so evaluation is noisy and wrong. Pass "
            f"training=self.training (or use nn.{'Dropout' if function == 'dropout' else function.capitalize()})")


_UNSET: Any = object()  # ``training`` not passed: what the rule looks for
_PARAMETERS = ("input", "p", "training", "inplace")


def _look(function: str, caller: FrameType, p: Any) -> None:
    """``F.<function>`` was called without ``training``: is its caller the forward of an eval-mode module?"""
    __tracebackhide__ = True  # noqa: F841
    try:
        code = caller.f_code
        if code.co_argcount and code.co_varnames[0] == "self" and not is_internal(code):
            module = caller.f_locals.get("self")
            # a tensor p is not read (on a device, reading it would make the host wait): such a call is not looked at
            if isinstance(module, nn.Module) and not module.training and isinstance(p, (int, float)) and p != 0:
                shown = f"F.{function}(...)"
                report(CODE, caller, lambda: _message(function, module, quoted_call(caller, shown, 80), code.co_name))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _sdpa_message(module: nn.Module, shown: str, method: str) -> str:
    return (f"{CODE} {shown} in {type(module).__name__}.{method}() keeps dropping attention weights after .eval(): "
            f"dropout_p applies whatever the module's mode, so evaluation is noisy and wrong. Write: "
            f"dropout_p=self.dropout if self.training else 0.0")


def _look_sdpa(caller: FrameType, p: Any) -> None:
    """``F.scaled_dot_product_attention`` with a non-zero ``dropout_p``: is its caller an eval-mode module's?"""
    __tracebackhide__ = True  # noqa: F841
    try:
        code = caller.f_code
        if code.co_argcount and code.co_varnames[0] == "self" and not is_internal(code):
            module = caller.f_locals.get("self")
            if isinstance(module, nn.Module) and not module.training and isinstance(p, (int, float)):
                shown = "F.scaled_dot_product_attention(...)"
                report(CODE, caller, lambda: _sdpa_message(module, quoted_call(caller, shown, 100), code.co_name))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)


def _sdpa(original: Any) -> Any:
    """A plain function in front of torch's builtin: one call and one test of ``dropout_p`` per attention."""
    look, getframe, compiling = _look_sdpa, sys._getframe, is_compiling

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841
        p = kwargs["dropout_p"] if "dropout_p" in kwargs else args[4] if len(args) > 4 else 0.0
        if p and not compiling():
            look(getframe(1), p)
        return original(*args, **kwargs)

    # torch's builtin has no signature that `inspect` can read; a Python function is expected to have one (code that
    # lists torch.nn.functional's functions by their parameters reads it): torch's documented one.
    scaled_dot_product_attention.__signature__ = _SDPA_SIGNATURE  # type: ignore[attr-defined]
    return scaled_dot_product_attention


_SDPA_SIGNATURE = inspect.Signature([
    *(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("query", "key", "value")),
    *(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
      for name, default in (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False))),
    *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
      for name, default in (("scale", None), ("enable_gqa", False))),
])


_registered: list[Any] = []


def _known_to_torchscript(replacement: Any) -> None:
    """TorchScript compiles a call of a builtin by the function's identity: the replacement is that builtin too."""
    try:
        from torch.jit import _builtins

        _builtins._register_builtin(replacement, "aten::scaled_dot_product_attention")
        _registered.append(replacement)  # the table is keyed by id(): kept alive, so that no id is reused
    except Exception as exc:  # a torch without this table: scripted attention is then not scripted through us
        internal_error(CODE, exc, "could not register scaled_dot_product_attention with TorchScript")


def _replacement(function: str) -> Any:
    """A plain function with torch's signature, not a wrapt proxy: ``nn.Dropout`` calls it at every forward, and
    it pays one call (torch's function called with a plain positional call) and one identity test. TorchScript
    compiles what a scripted forward calls from its source (torch's, through ``__wrapped__``) and resolves its names
    in the function's globals and closure: the replacement has torch's globals, and reaches its own helpers through
    its closure only (`safetorch._patch.with_globals_of`)."""

    def factory(original: Any) -> Any:
        look, getframe, unset, hide = _look, sys._getframe, _UNSET, hide_own_frames
        if tuple(inspect.signature(original).parameters) != _PARAMETERS:

            def dropout_any(*args: Any, **kwargs: Any) -> Any:  # a torch with other parameters than the known ones
                __tracebackhide__ = True  # noqa: F841
                try:
                    if len(args) < 3 and "training" not in kwargs:
                        look(function, getframe(1), args[1] if len(args) > 1 else kwargs.get("p", 0.5))
                    return original(*args, **kwargs)
                except BaseException as exc:  # no frame of ours in the traceback of what passes through
                    hide(exc)
                    raise

            return with_globals_of(original, dropout_any)

        def dropout(input: Any, p: Any = 0.5, training: Any = unset, inplace: Any = False) -> Any:
            __tracebackhide__ = True  # noqa: F841
            try:
                if training is unset:
                    training = True
                    look(function, getframe(1), p)
                return original(input, p, training, inplace)
            except BaseException as exc:  # no frame of ours in the traceback of what passes through
                hide(exc)
                raise

        return with_globals_of(original, dropout)

    return factory


_made: dict[str, Any] = {}  # function name -> its replacement, made once (TorchScript knows attention's by identity)


def _once(name: str, factory: Any) -> Any:
    def make(original: Any) -> Any:
        made = _made.get(name)
        if made is None or made.__wrapped__ is not original:
            made = _made[name] = factory(original)
            made.__wrapped__ = original
        return made

    return make


#: (owner, name, torch's function, its replacement): what `_arm` swaps, ``F``'s functions and the names the program
#: bound from them before safetorch was installed (``from torch.nn.functional import dropout``).
_swaps: list[tuple[Any, str, Any, Any]] = []


def _arm(on: bool) -> None:
    """The replacements stand only while a module the program put in eval mode is in it (`eval_mode_grad`'s
    `watch_evaluation`): a training forward's ``nn.Dropout`` calls torch's function untouched. The registry put them in
    place once; this swaps them with torch's functions (a few attribute stores: an ``eval()`` every few steps pays
    nothing to speak of), and a restore puts back torch's whichever stands."""
    for owner, name, original, replacement in _swaps:
        current = vars(owner).get(name)
        if on and current is original:
            setattr(owner, name, replacement)
        elif not on and current is replacement:
            setattr(owner, name, original)


def install(registry: Registry) -> None:
    from .. import _install

    _swaps.clear()
    originals: dict[int, Any] = {}
    for function in _FUNCTIONS:
        installed = registry.replace(F, function, _once(function, _replacement(function)), CODE)
        _swaps.append((F, function, installed.__wrapped__, installed))
        originals[id(installed.__wrapped__)] = installed
    if hasattr(F, "scaled_dot_product_attention"):
        attention = registry.replace(F, "scaled_dot_product_attention", _once("sdpa", _sdpa), CODE)
        if not any(attention is known for known in _registered):
            _known_to_torchscript(attention)
        _swaps.append((F, "scaled_dot_product_attention", attention.__wrapped__, attention))
        originals[id(attention.__wrapped__)] = attention
    for module, attribute, original in _install.early_bindings({key: r.__wrapped__ for key, r in originals.items()}):
        replacement = originals[id(original)]
        registry.set(module, attribute, replacement, CODE)
        _swaps.append((module, attribute, original, replacement))
    eval_mode_grad.watch_evaluation(CODE, _arm)


def uninstall() -> None:
    eval_mode_grad.watch_evaluation(CODE, None)
    _arm(False)  # torch's functions, whichever stood when the registry restored (it runs first)
    _swaps.clear()
