"""95 % percentile-bootstrap intervals over prompts for the comparison's ratio figures: tau and the speedups.

What the interval covers. The prompts of a run are a sample of the prompts one cares about; another sample
of the same size would give another tau and another speedup. A resample draws as many prompts as the run
has, with replacement, and recomputes the figure on them exactly as the point figure is computed on all of
them; the 2.5th and 97.5th percentiles of 2000 such figures bound it. So the interval says how much the
figure rests on which prompts were asked: prompt-to-prompt variation. Timing noise is not what it measures:
the repeats of a prompt decode the same tokens, and the figure (here as in the point figure) is the median
over repeats of each repeat's figure, which damps a slow pass rather than resampling it. A prompt's own
timing noise still moves its seconds, so a run of one pass folds that noise into the spread between prompts.

Ratio of sums, never a mean of ratios. Tau is Σ committed tokens / Σ rounds, tokens/s is Σ tokens / Σ
seconds: long prompts weigh by their rounds and their seconds, as they do in the point figure. A mean of
per-prompt ratios would be another statistic (each prompt weighing the same), and its interval would not
be an interval for the figure reported beside it.

Paired. A speedup is one method's tokens/s over another's on the SAME drawn prompts: a prompt that is slow
for DDTree (long context, hard text) is slow for AR too, and that shared difficulty cancels in the ratio.
Drawing the two methods' prompts apart would add both methods' prompt-to-prompt spread to the ratio's and
give an interval many times wider than the uncertainty of the comparison itself (tests/test_bootstrap.py).

Deterministic: the draws come from `random.Random(SEED)` (its sequence is fixed across Python versions and
platforms), so the same run gives the same interval, and every figure of a run is resampled with the same
draws. Fewer than two prompts have no spread to resample: no interval (None), never a zero-width interval
pretending certainty. Identical prompts do give a zero-width interval: there the data show no spread.

Torch and the standard library only (the worker runs under the compat venv as well).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

import torch

from remote_worker.decoding.figure_rules import MIN_PROMPTS, Interval

RESAMPLES = 2000
LEVEL = 0.95
SEED = 23  # any fixed number: what matters is that it never changes between runs


@functools.lru_cache(maxsize=8)
def _counts(prompts: int, resamples: int, seed: int) -> torch.Tensor:
    """(resamples, prompts), float64: how many times each prompt is drawn in each resample."""
    rng = random.Random(seed)
    population = range(prompts)
    rows = []
    for _ in range(resamples):
        row = [0.0] * prompts
        for index in rng.choices(population, k=prompts):
            row[index] += 1.0
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def resampled_sums(per_prompt: torch.Tensor, resamples: int = RESAMPLES, seed: int = SEED) -> torch.Tensor | None:
    """Sums over the prompts of each resample: `per_prompt` is (prompts, …), the result (resamples, …).
    None with fewer than two prompts."""
    prompts = per_prompt.shape[0]
    if prompts < 2:
        return None
    counts = _counts(prompts, resamples, seed)
    return torch.tensordot(counts, per_prompt.to(torch.float64), dims=1)


def percentiles(values: torch.Tensor, level: float = LEVEL) -> Interval:
    """The percentile interval of the resampled figures (linear interpolation between order statistics)."""
    tail = (1 - level) / 2
    low, high = torch.quantile(values.to(torch.float64), torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return Interval(float(low), float(high))


def ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where the denominator is 0 (as the point figures read an empty run)."""
    safe = torch.where(denominator != 0, denominator, torch.ones_like(denominator))
    return torch.where(denominator != 0, numerator / safe, torch.zeros_like(numerator))


def speedup(
    tokens: torch.Tensor, seconds: torch.Tensor, base_tokens: torch.Tensor, base_seconds: torch.Tensor
) -> torch.Tensor:
    """Tokens/s over the base's within each repeat (the last dimension), then the median over repeats: the
    point figure's own recipe, on sums over prompts, (…, repeats) → (…)."""
    per_repeat = ratio(ratio(tokens, seconds), ratio(base_tokens, base_seconds))
    return torch.quantile(per_repeat, 0.5, dim=-1)  # an even count: the mean of the middle two, as statistics'


def bootstrap(
    per_prompt: torch.Tensor,
    figure: Callable[[torch.Tensor], torch.Tensor],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> Interval | None:
    """The interval of `figure`, a function of sums over prompts ((resamples, …) → (resamples,)), over
    resamples of the prompts (the rows of `per_prompt`). None with fewer than two prompts."""
    sums = resampled_sums(per_prompt, resamples, seed)
    return None if sums is None else percentiles(figure(sums), level)


def tau_interval(
    committed: Sequence[float], rounds: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED
) -> Interval | None:
    """Tau's interval: per prompt, the tokens committed over its rounds (bonus included) and its rounds. None
    with fewer than MIN_PROMPTS prompts."""
    if len(committed) < MIN_PROMPTS:
        return None
    per_prompt = torch.tensor([committed, rounds], dtype=torch.float64).T  # (prompts, 2)
    return bootstrap(per_prompt, lambda sums: ratio(sums[:, 0], sums[:, 1]), resamples, seed=seed)


def speedup_interval(
    tokens: Sequence[Sequence[float]],
    seconds: Sequence[Sequence[float]],
    base_tokens: Sequence[Sequence[float]],
    base_seconds: Sequence[Sequence[float]],
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Interval | None:
    """A method's speedup over a base (AR; DFlash for DDTree), paired: both on the same drawn prompts. Each
    argument holds, per prompt, one entry per repeat (generated tokens, decode seconds); both methods
    decoded the same prompts the same number of times. None with fewer than MIN_PROMPTS prompts."""
    if len(tokens) < MIN_PROMPTS:
        return None
    columns = [torch.tensor(c, dtype=torch.float64) for c in (tokens, seconds, base_tokens, base_seconds)]
    if len({c.shape for c in columns}) != 1 or columns[0].dim() != 2:
        raise ValueError(f"one entry per prompt and repeat, alike for both methods: {[c.shape for c in columns]}")
    per_prompt = torch.stack(columns, dim=1)  # (prompts, 4, repeats)
    return bootstrap(per_prompt, lambda sums: speedup(*sums.unbind(dim=1)), resamples, seed=seed)
