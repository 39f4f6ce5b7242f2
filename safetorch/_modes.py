"""What eval mode changes in a module: the effects a finding about a module's mode may name (ST008).

``eval()`` sets ``training = False`` on every submodule; that changes the numbers only where some code reads the flag.
torch's own layers that do are told by their settings: dropout with ``p > 0`` (``nn.Dropout*``, an RNN's dropout
between layers, ``nn.MultiheadAttention``'s), BatchNorm and InstanceNorm that track running statistics. Any other
class (the program's own blocks, a library's, torch's ``RReLU``) counts when its own code reads an attribute named
``training`` or when it overrides ``train()``: read from its functions' bytecode, once per class; so does a forward
hook of a module that reads it (the old ``torch.nn.utils.spectral_norm``).

Design rules: asked only when a finding is about to be reported, never on the per-step path; it errs toward "has an
effect" (a ``self.training`` that guards nothing numeric still counts), so that a finding is never dropped for a model
whose numbers its mode changes.
"""

from __future__ import annotations

from types import CodeType
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = ["eval_effects", "joined", "train_effects"]

#: torch classes whose effect is read from their settings, not from their code (which reads ``training`` always).
_BY_SETTINGS = (_DropoutNd, _NormBase, nn.RNNBase, nn.MultiheadAttention)
_SKIPPED = frozenset({object, nn.Module})
_by_class: dict[type, tuple[str, ...]] = {}


def eval_effects(module: nn.Module) -> list[str]:
    """What eval mode changes in ``module`` now, as clauses for a message ("dropout is off", ...), in a fixed order;
    empty when no eval-mode submodule's numbers depend on the mode. A submodule in training mode counts for nothing."""
    dropout = False
    norms: dict[str, None] = {}  # ordered sets
    others: dict[str, None] = {}
    for sub in module.modules():
        if sub.training:
            continue
        dropout = dropout or _drops(sub)
        if _tracks_statistics(sub):
            norms.setdefault("InstanceNorm" if isinstance(sub, _InstanceNorm) else "BatchNorm")
        for reason in _class_reasons(type(sub)):
            others.setdefault(reason)
        if _hooks_read_training(sub):  # torch.nn.utils.spectral_norm's power iteration runs in training mode only
            others.setdefault(f"a forward hook on {type(sub).__name__} reads its .training")
    effects = ["dropout is off"] if dropout else []
    if norms:
        effects.append(" and ".join(norms) + (" uses its" if len(norms) == 1 else " use their") + " running statistics")
    return effects + list(others)


def train_effects(module: nn.Module) -> list[str]:
    """What training mode does now to a forward of ``module`` that only evaluates (ST019), as clauses: its BatchNorm
    layers fold the batches into their running statistics, its dropout drops activations. Empty when neither: torch's
    own layers only, told by their settings (the rule stays silent for a model whose evaluation the mode leaves
    alone)."""
    norms = dropout = 0
    for sub in module.modules():
        if not sub.training:
            continue
        if isinstance(sub, _NormBase) and sub.track_running_stats and getattr(sub, "running_mean", None) is not None \
                and sub.momentum != 0:
            norms += 1
        elif _drops(sub):
            dropout += 1
    effects = []
    if norms:
        layers = "its BatchNorm layer" if norms == 1 else f"its {norms} BatchNorm layers"
        effects.append(f"{layers} folded these batches into the running statistics that evaluation uses later")
    if dropout:
        effects.append("dropout was on")
    return effects


def joined(clauses: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(clauses[:-1]) + " and " + clauses[-1] if len(clauses) > 1 else "".join(clauses)


def _drops(module: nn.Module) -> bool:
    if isinstance(module, _DropoutNd):
        return module.p > 0
    if isinstance(module, nn.RNNBase):
        return module.dropout > 0 and module.num_layers > 1
    if isinstance(module, nn.MultiheadAttention):
        return module.dropout > 0
    return False


def _tracks_statistics(module: nn.Module) -> bool:
    """BatchNorm/InstanceNorm in eval mode normalise by running statistics when they have them (torch's F.batch_norm:
    batch statistics when both are None; InstanceNorm only with ``track_running_stats``)."""
    if not isinstance(module, _NormBase) or not module.track_running_stats:
        return False
    return getattr(module, "running_mean", None) is not None or getattr(module, "running_var", None) is not None


def _class_reasons(cls: type) -> tuple[str, ...]:
    reasons = _by_class.get(cls)
    if reasons is None:
        reasons = _by_class[cls] = _scan(cls)
    return reasons


def _scan(cls: type) -> tuple[str, ...]:
    """Why ``cls``'s own code depends on the mode, read from the functions of its classes (but Module's, and those of
    torch's classes told by their settings); () when it does not."""
    for klass in cls.__mro__:
        if klass in _SKIPPED or (issubclass(klass, _BY_SETTINGS) and klass.__module__.startswith("torch.")):
            continue
        for name, value in list(vars(klass).items()):
            if name == "train" and callable(value):
                return (f"{cls.__name__} overrides train()",)
            code = _code_of(value)
            if code is not None and _reads_training(code):
                return (f"{cls.__name__} reads self.training",)
    return ()


def _hooks_read_training(module: nn.Module) -> bool:
    hooks = [*getattr(module, "_forward_pre_hooks", {}).values(), *getattr(module, "_forward_hooks", {}).values()]
    for hook in hooks:
        code = _code_of(hook) or (_code_of(type(hook).__call__) if callable(hook) else None)
        if code is not None and _reads_training(code):
            return True
    return False


def _code_of(value: Any) -> CodeType | None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    code = getattr(value, "__code__", None)
    return code if isinstance(code, CodeType) else None


def _reads_training(code: CodeType) -> bool:
    return "training" in code.co_names or any(
        isinstance(const, CodeType) and _reads_training(const) for const in code.co_consts)

