"""Figures rounded to what they mean, before MLflow shows them: `0.0312`, not `0.031245678901234567`.

MLflow's pages print a metric's value whole, so a prediction's error read as a 17-digit fraction and a tau as
ten decimals. The figures sent are rounded here by what they measure (their name says it); the run's own
files (`decode_summary.json`) keep every digit.
"""

from __future__ import annotations

import math

# (a part of the metric's name, the decimals it keeps): the first that matches decides.
DECIMALS = (
    ("error", 4),  # relative errors and fractions: 0.0312 is 3.12 %
    ("lossless", 4),
    ("share", 4),
    ("percentage", 2),
    ("tokens_per_s", 1),
    ("tau", 3),
    ("acceptance", 3),  # tokens accepted per round, as tau
    ("speedup", 3),
    ("_ms", 3),
    ("_mb", 1),
    ("_s", 2),
)
SIGNIFICANT = 6  # anything else


def meaningful(name: str, value: float) -> float:
    """`value` rounded for the figure `name` measures (see DECIMALS); NaN and infinities as they are."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return value
    for part, decimals in DECIMALS:
        if part in name:
            return round(float(value), decimals)
    if value == 0:
        return 0.0
    return round(float(value), SIGNIFICANT - 1 - math.floor(math.log10(abs(value))))


def rounded(metrics: dict[str, float]) -> dict[str, float]:
    """Every figure of `metrics` rounded by its name (their order kept: a run page lists them in it)."""
    return {name: meaningful(name, value) for name, value in metrics.items()}
