"""The stable table of rule codes: code, short name, warning category, one-line summary.

This table is the contract (design.md); a check module refers to its row by code. Names are accepted wherever
codes are (``SAFETORCH_IGNORE=graph-accumulation``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._exceptions import (
    DiscardedConversionWarning,
    EmptyCacheLoopWarning,
    EvalModeGradWarning,
    EvalModeTrainingWarning,
    GraphAccumulationWarning,
    LegacyReductionWarning,
    NonFiniteLossWarning,
    SafetorchWarning,
    VolatileVariableWarning,
)


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    category: type[SafetorchWarning]
    summary: str
    #: Under torchrun every rank runs the same code, so a finding is printed by rank 0 only; a per-rank finding
    #: (a NaN loss on one rank's data) is printed by each rank that sees it, with its rank.
    per_rank: bool = False


RULES: dict[str, Rule] = {
    r.code: r
    for r in (
        Rule("ST001", "discarded-conversion", DiscardedConversionWarning,
             "result of an out-of-place tensor conversion discarded"),
        Rule("ST002", "legacy-reduction", LegacyReductionWarning,
             "legacy size_average/reduce or reduction='elementwise_mean' on a loss"),
        Rule("ST003", "eval-mode-grad", EvalModeGradWarning,
             "forward of an eval-mode model with autograd on, for nothing"),
        Rule("ST004", "graph-accumulation", GraphAccumulationWarning,
             "a loss carrying a graph accumulated into a Python number"),
        Rule("ST005", "volatile-variable", VolatileVariableWarning,
             "Variable(..., volatile=True), which has no effect since torch 0.4"),
        Rule("ST006", "non-finite-loss", NonFiniteLossWarning,
             "a NaN or infinite loss reaching backward()", per_rank=True),
        Rule("ST007", "empty-cache-loop", EmptyCacheLoopWarning,
             "torch.cuda.empty_cache() called over and over from one line"),
        Rule("ST008", "eval-mode-training", EvalModeTrainingWarning,
             "an optimizer trains parameters of a model called top-level in eval mode"),
    )
}

_BY_NAME = {r.name: r.code for r in RULES.values()}


def resolve(token: str) -> str | None:
    """Return the code for a code or name (any case), or None when it names no rule."""
    t = token.strip()
    if t.upper() in RULES:
        return t.upper()
    return _BY_NAME.get(t.lower())


def valid_tokens() -> str:
    return ", ".join(f"{r.code} ({r.name})" for r in RULES.values())
