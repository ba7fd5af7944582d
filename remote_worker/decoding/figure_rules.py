"""What the worker's figures mean that the orchestrator's pages read too, free of torch.

The orchestrator builds a sweep's page and the paper's table from these; importing them through
`bootstrap` or `comparison` cost every orchestrator process torch's and transformers' imports (about 5 s of
CPU a sweep, 2 s a plain run) for two constants and a pair of floats.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


# The fewest prompts an interval rests on. A percentile bootstrap over n prompts draws from n^n resamples with
# few distinct sums: at 2–4 prompts its "95 %" interval is a handful of values, far narrower than the truth
# (two prompts give three distinct sums), so it is not printed as one; the figure says its prompt count.
MIN_PROMPTS = 5

# AR's figures that are 1 by definition (tau: one token a round; speedup: itself; lossless: its own tokens).
# Kept in its own run's figures, but never a headline metric of a job or a sweep: charts and the compare view
# sort them first (`ar.*`), where they crowded out the figures that vary.
AR_BY_DEFINITION = ("tau", "speedup_vs_ar", "lossless")
