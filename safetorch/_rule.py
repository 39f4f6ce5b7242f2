"""`Rule`: how a check declares its rule, once, in its own module (``RULE = Rule(...)``).

Everything else is derived from those declarations (`safetorch._rules`): the package's exports and ``__all__``, the
installer's table, the runner's help, the names ``SAFETORCH_IGNORE`` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._exceptions import SafetorchWarning


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    #: The rule's own `SafetorchWarning` subclass: users filter one rule by it.
    category: type[SafetorchWarning]
    summary: str
    #: Under torchrun every rank runs the same code, so a finding is printed by rank 0 only; a per-rank finding
    #: (a NaN loss on one rank's data) is printed by each rank that sees it, with its rank.
    per_rank: bool = False
    #: Seen only at the steps `safetorch._steps` looks at (an optimizer's first 8, then two every 1024 backwards): its
    #: count is of those, not of every step that had it, and the summary says so ("seen at 7 sampled steps").
    sampled: bool = False
    #: The check module under ``safetorch.checks`` that installs it (set by `safetorch._rules` when it collects).
    module: str = ""

    def __post_init__(self) -> None:
        if self.category.code != self.code:
            raise ValueError(f"{self.category.__name__}.code is {self.category.code!r}, not {self.code!r}")
        # Shown (and pickled) as safetorch.X, which the package exports.
        self.category.__module__ = "safetorch"
