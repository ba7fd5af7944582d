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

# The method (and its child run's name) of DDTree with a budget per round (`decode.online_budget=true`).
ONLINE = "ddtree_online"


def versus_best_fixed(metrics: dict[str, float]) -> str:
    """`ddtree_online`'s figures against the fastest fixed budget (`speedup_vs_best_fixed`, its interval and
    `best_fixed_budget`), in the words the terminal and the job's page both print, ahead or behind only beyond
    the 95 % interval: `ran ×0.97 (0.91–1.03) the speed of DDTree-32, the fastest fixed budget here (picked
    after the fact): level with it within the 95 % interval`. Empty where the method has no such figure."""
    if "speedup_vs_best_fixed" not in metrics:
        return ""
    text = f"ran ×{metrics['speedup_vs_best_fixed']:.2f}"
    low, high = metrics.get("speedup_vs_best_fixed_ci_low"), metrics.get("speedup_vs_best_fixed_ci_high")
    if low is not None and high is not None:
        text += f" ({low:.2f}–{high:.2f})"
        verdict = (
            "ahead of it beyond the 95 % interval" if low > 1
            else "behind it beyond the 95 % interval" if high < 1
            else "level with it within the 95 % interval"
        )  # fmt: skip
    else:
        verdict = f"too few prompts to tell (an interval needs {MIN_PROMPTS})"
    best = f"DDTree-{int(metrics.get('best_fixed_budget', 0))}"
    return f"{text} the speed of {best}, the fastest fixed budget here (picked after the fact): {verdict}"
