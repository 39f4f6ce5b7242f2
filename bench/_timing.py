"""Interleaved timing: every variant is measured in each round, in a shuffled order, so drift hits all alike."""

from __future__ import annotations

import random
import statistics
import timeit
from collections.abc import Callable
from typing import Any


def interleaved(variants: dict[str, tuple[Callable[[], None], Callable[[], None]]], stmt: Callable[[], Any],
                number: int, repeats: int, seed: int = 0) -> dict[str, list[float]]:
    """Time ``stmt`` ``number`` times per sample under each variant; ``variants[name] = (enter, leave)``.

    Returns ns per call, one sample per round, per variant.
    """
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for _ in range(repeats):
        rng.shuffle(names)
        for name in names:
            enter, leave = variants[name]
            enter()
            try:
                stmt()  # warm the caches of this variant
                t = timeit.timeit(stmt, number=number)
            finally:
                leave()
            samples[name].append(t / number * 1e9)
    return samples


def summary(samples: list[float]) -> dict[str, Any]:
    return {"samples": [round(s, 3) for s in samples], "median": round(statistics.median(samples), 3)}


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[i] / b[i]: each ratio compares two samples taken side by side."""
    return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 3)
