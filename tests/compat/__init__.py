"""The compatibility corpus: safetorch stays invisible on correct code."""

from typing import Any

#: What the corpus ran, for the terminal summary: sets of names and counts of samples.
COUNTS: dict[str, Any] = {"modules": set(), "module samples": 0, "ops": set(), "op samples": 0}
