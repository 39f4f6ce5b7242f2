"""ST008: an optimizer trains the parameters of a model that is in eval mode (dropout off, BatchNorm frozen).

The machinery is ST003's (`eval_mode_grad`): the first eval-mode forward at a call site is watched, and when a
backward reaches it and an optimizer step then updates parameters of that module, ST008 is reported once at the
forward's line, naming who put the module in eval mode. This module only switches that report on and off.
"""

from __future__ import annotations

from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._rule import Rule
from . import eval_mode_grad

CODE = eval_mode_grad.TRAINING_CODE


class EvalModeTrainingWarning(SafetorchWarning):
    """ST008: an optimizer trains parameters of a model called in eval mode (dropout off, BatchNorm frozen)."""

    code = "ST008"


RULE = Rule("ST008", "eval-mode-training", EvalModeTrainingWarning,
            "an optimizer trains parameters of a model called top-level in eval mode")


def install(registry: Registry) -> None:
    eval_mode_grad.enable(CODE, registry)


def uninstall() -> None:
    eval_mode_grad.disable(CODE)
