"""The 95 % bootstrap intervals over prompts: deterministic, inside the per-prompt spread, paired, and covering a
known truth about as often as a 95 % interval should."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterator

import pytest
import torch

from remote_worker.decoding import bootstrap
from remote_worker.decoding.bootstrap import (
    MIN_PROMPTS,
    percentiles,
    ratio,
    resampled_sums,
    speedup_interval,
    tau_interval,
)

pytestmark = pytest.mark.worker


Prompts = tuple[list[int], list[int], list[list[int]], list[list[float]], list[list[float]]]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Hundreds of small matrix products: on a busy machine, waking torch's threads costs more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _prompts(seed: int, n: int = 12) -> Prompts:
    """Prompts that differ: committed tokens and rounds (tau between ~1.5 and ~5), generated tokens, and one
    pass of decode seconds for a method and for AR (per-prompt speedups between ~1.2 and ~3)."""
    rng = random.Random(seed)
    rounds = [rng.randint(5, 60) for _ in range(n)]
    committed = [round(r * rng.uniform(1.5, 5.0)) for r in rounds]
    tokens = [[rng.randint(40, 200)] for _ in range(n)]
    ar = [[t[0] * rng.uniform(0.01, 0.05)] for t in tokens]
    method = [[s[0] / rng.uniform(1.2, 3.0)] for s in ar]
    return committed, rounds, tokens, method, ar


def test_the_same_figures_give_the_same_interval() -> None:
    committed, rounds, tokens, method, ar = _prompts(0)
    assert tau_interval(committed, rounds) == tau_interval(list(committed), list(rounds))
    bootstrap._counts.cache_clear()  # drawn afresh, not read back from the cache: the same draws
    assert speedup_interval(tokens, method, tokens, ar) == speedup_interval(tokens, method, tokens, ar)
    assert tau_interval(committed, rounds) != tau_interval(committed, rounds, seed=1)  # the seed is what fixes it


@pytest.mark.parametrize("seed", range(5))
def test_the_interval_holds_the_figure_and_lies_within_the_per_prompt_spread(seed: int) -> None:
    committed, rounds, tokens, method, ar = _prompts(seed)
    tau = sum(committed) / sum(rounds)  # ratio of sums, as the tally reports it
    per_prompt_tau = [c / r for c, r in zip(committed, rounds, strict=True)]
    interval = tau_interval(committed, rounds)
    assert interval is not None
    assert min(per_prompt_tau) <= interval.low < tau < interval.high <= max(per_prompt_tau)

    flat = [t[0] for t in tokens]
    speedup = (sum(flat) / sum(s[0] for s in method)) / (sum(flat) / sum(s[0] for s in ar))
    per_prompt_speedup = [a[0] / m[0] for m, a in zip(method, ar, strict=True)]  # the same tokens for both
    interval = speedup_interval(tokens, method, tokens, ar)
    assert interval is not None
    assert min(per_prompt_speedup) <= interval.low < speedup < interval.high <= max(per_prompt_speedup)
    # not a degenerate interval, nor the whole spread: it is the uncertainty of a mean over 12 prompts
    assert interval.high - interval.low < max(per_prompt_speedup) - min(per_prompt_speedup)


def test_with_repeats_the_figure_is_the_median_over_repeats_as_reported() -> None:
    """Three passes: each pass's speedup over all prompts, then their median, is the reported figure; the
    interval resamples the prompts of that same recipe, so it holds it."""
    rng = random.Random(3)
    tokens = [[100, 100, 100] for _ in range(8)]
    ar = [[rng.uniform(1, 3) * (1 + 0.3 * (r == 2)) for r in range(3)] for _ in range(8)]  # pass 2 slow
    method = [[s / rng.uniform(1.5, 2.5) for s in seconds] for seconds in ar]
    passes = [sum(a[r] for a in ar) / sum(m[r] for m in method) for r in range(3)]
    interval = speedup_interval(tokens, method, tokens, ar)
    assert interval is not None and interval.low < statistics.median(passes) < interval.high
    every = [a[r] / m[r] for a, m in zip(ar, method, strict=True) for r in range(3)]
    assert min(every) <= interval.low and interval.high <= max(every)


def test_identical_prompts_give_a_zero_width_interval_at_the_figure() -> None:
    interval = tau_interval([30] * 6, [10] * 6)
    assert interval == bootstrap.Interval(3.0, 3.0)
    interval = speedup_interval([[64, 64]] * 6, [[0.2, 0.2]] * 6, [[64, 64]] * 6, [[0.5, 0.5]] * 6)
    assert interval is not None
    assert (interval.low, interval.high) == pytest.approx((2.5, 2.5), rel=1e-12)


def test_fewer_than_five_prompts_have_no_interval() -> None:
    """Two prompts give three distinct resampled sums, four give 35: a "95 % interval" of so few values reads far
    narrower than the spread it stands for, so none is given (`MIN_PROMPTS`)."""
    assert tau_interval([], []) is None and tau_interval([12], [4]) is None
    assert speedup_interval([], [], [], []) is None
    assert speedup_interval([[10]], [[1.0]], [[10]], [[2.0]]) is None
    assert tau_interval([12, 8, 9, 11], [4, 4, 3, 5]) is None
    assert MIN_PROMPTS == 5 and tau_interval([12, 8, 9, 11, 10], [4, 4, 3, 5, 4]) is not None


def test_pairing_cancels_the_difficulty_both_methods_share() -> None:
    """Prompts differ tenfold in how slow they are, for AR and the method alike (long context, hard text);
    the method is twice as fast on each, give or take 5 %. Drawing both on the same prompts, the shared
    difficulty cancels in the ratio; drawing them apart would add it to the ratio's spread."""
    rng = random.Random(7)
    n = 30
    tokens = [[128.0] for _ in range(n)]
    ar = [[0.1 * 10 ** rng.uniform(0, 1)] for _ in range(n)]
    method = [[s[0] / 2 * rng.uniform(0.95, 1.05)] for s in ar]
    paired = speedup_interval(tokens, method, tokens, ar)
    assert paired is not None and paired.low < 2 < paired.high
    # unpaired: the method's and AR's prompts drawn independently (two seeds)
    per_prompt = torch.tensor([[t[0], s[0]] for t, s in zip(tokens, method, strict=True)], dtype=torch.float64)
    base = torch.tensor([[t[0], s[0]] for t, s in zip(tokens, ar, strict=True)], dtype=torch.float64)
    mine, theirs = resampled_sums(per_prompt, seed=1), resampled_sums(base, seed=2)
    assert mine is not None and theirs is not None
    unpaired = percentiles(ratio(mine[:, 0], mine[:, 1]) / ratio(theirs[:, 0], theirs[:, 1]))
    assert unpaired.low < 2 < unpaired.high
    assert (paired.high - paired.low) * 10 < unpaired.high - unpaired.low


def _least_covered(trials: int, coverage: float, chance: float) -> int:
    """The largest k with P(X < k) < chance for X ~ Binomial(trials, coverage): seeing fewer than k intervals
    cover the truth is that unlikely for an interval that covers it with probability `coverage` (or more:
    the tail only shrinks as coverage grows)."""
    below, k = 0.0, 0
    while below + math.comb(trials, k) * coverage**k * (1 - coverage) ** (trials - k) < chance:
        below += math.comb(trials, k) * coverage**k * (1 - coverage) ** (trials - k)
        k += 1
    return k


def test_the_interval_covers_a_known_truth_about_95_percent_of_the_time(one_thread: None) -> None:
    """200 synthetic runs of 30 prompts from a known population; each run's 95 % intervals for tau and for the
    speedup should cover the population's values.

    The truth: a prompt has r ~ U{5..60} rounds, committing r·(1 + 4p) tokens with p ~ U(0.2, 0.8) drawn
    apart, so tau = E[r(1 + 4p)] / E[r] = 1 + 4·E[p] = 3. It generates t ~ U{40..200} tokens; AR takes
    t·d seconds (d ~ U(0.01, 0.05)) and the method t·d·h (h ~ U(0.3, 0.7), drawn apart), so the speedup
    (E[t]/E[t·d·h]) / (E[t]/E[t·d]) = E[t·d] / (E[t·d]·E[h]) = 1 / 0.5 = 2.

    The bound: a percentile bootstrap covers a smooth statistic such as a ratio of means somewhat less
    often than its nominal 95 % at n = 30; 0.90 is a safe floor (0.93 over 2000 such runs). The runs are
    independent (the resampling draws are fixed, the data fresh each run), so the number covered is
    Binomial(200, ≥0.90), and fewer than 157 covered has probability below 1e-6 (`_least_covered`). Too-wide
    intervals would pass that, so their widths are also held to the real spread of the figure: the mean
    width against 2 × 1.96 × the standard deviation of the 200 runs' own figures."""
    trials, n = 200, 30
    rng = random.Random(11)
    covered = {"tau": 0, "speedup": 0}
    widths: dict[str, list[float]] = {"tau": [], "speedup": []}
    figures: dict[str, list[float]] = {"tau": [], "speedup": []}
    for _ in range(trials):
        rounds = [rng.randint(5, 60) for _ in range(n)]
        committed = [r * (1 + 4 * rng.uniform(0.2, 0.8)) for r in rounds]
        tokens = [[rng.randint(40, 200)] for _ in range(n)]
        ar = [[t[0] * rng.uniform(0.01, 0.05)] for t in tokens]
        method = [[s[0] * rng.uniform(0.3, 0.7)] for s in ar]
        speedup = sum(a[0] for a in ar) / sum(m[0] for m in method)  # the same tokens for both: seconds over seconds
        for name, truth, interval, figure in (
            ("tau", 3.0, tau_interval(committed, rounds), sum(committed) / sum(rounds)),
            ("speedup", 2.0, speedup_interval(tokens, method, tokens, ar), speedup),
        ):
            assert interval is not None
            covered[name] += interval.low <= truth <= interval.high
            widths[name].append(interval.high - interval.low)
            figures[name].append(figure)
    least = _least_covered(trials, 0.90, 1e-6)
    assert least == 157
    for name in covered:
        assert covered[name] >= least, (name, covered[name])
        ratio_to_spread = statistics.fmean(widths[name]) / (2 * 1.96 * statistics.stdev(figures[name]))
        assert 0.8 < ratio_to_spread < 1.2, (name, ratio_to_spread)
