"""Methods side by side: one prefill per prompt, decode-only figures, repeats interleaved, medians with ranges."""

from __future__ import annotations

import time

import pytest
import torch

from remote_worker.decoding.comparison import (
    Comparison,
    Method,
    MethodTally,
    PromptRun,
    Settings,
    methods_for,
    run_prompt,
)
from remote_worker.decoding.loop import DecodeResult, decode_from, prefill
from remote_worker.models.target import TargetModel
from tests.tiny_models import random_prompt, tiny

pytestmark = pytest.mark.worker


class CountingTarget(TargetModel):
    """A tiny target that counts its prefills and makes each one slow: an extra 1.5 s, far more than a whole
    decode of this tiny model takes, even on a loaded machine."""

    def __init__(self, inner: TargetModel) -> None:
        self.__dict__.update(inner.__dict__)
        self.prefills = 0

    def prefill(self, cache, tokens, hidden_layers=(), chunk=64):
        self.prefills += 1
        time.sleep(1.5)
        return super().prefill(cache, tokens, hidden_layers, chunk)


def test_one_prefill_per_prompt_and_decode_times_exclude_it() -> None:
    target, draft = tiny("tiny_hybrid")
    counting = CountingTarget(target)
    methods = methods_for([4, 16])
    order: list[tuple[str, int]] = []
    run = run_prompt(
        counting,
        draft,
        random_prompt(3),
        methods,
        Settings(max_new_tokens=6, repeats=3),
        index=0,
        before_decode=lambda method, repeat: order.append((method.scope, repeat)),
    )
    assert counting.prefills == 1, "every method and repeat decodes from the one prefill"
    assert run.prefill_target_seconds >= 1.5
    # the methods take turns: repeat 0 of each, then repeat 1 of each, …
    assert order == [(m.scope, r) for r in range(3) for m in methods]
    for scope, results in run.results.items():
        assert len(results) == 3
        assert all(r.decode_seconds < 1.5 for r in results), scope  # the slow prefill is not in them
        assert all(r.tokens == results[0].tokens for r in results), "every repeat decodes the same tokens"
    assert run.first("dflash").tokens == run.first("ar").tokens == run.first("ddtree_tb16").tokens


def test_a_decode_leaves_the_prefilled_state_as_it_was() -> None:
    target, draft = tiny("tiny_dense")
    start = prefill(target, random_prompt(5), draft)
    length, context = start.cache.length, start.draft_context.length
    first = decode_from(target, start, method="ddtree", max_new_tokens=10, drafter=draft, budget=8)
    again = decode_from(target, start, method="ddtree", max_new_tokens=10, drafter=draft, budget=8)
    assert first.tokens == again.tokens and first.acceptance_lengths == again.acceptance_lengths
    assert (start.cache.length, start.draft_context.length) == (length, context)


def test_sampled_repeats_draw_the_same_tokens() -> None:
    """At temperature > 0 the repeats of a method time the same work: the generator is seeded per prompt."""
    target, draft = tiny("tiny_hybrid")
    run = run_prompt(
        target, draft, random_prompt(1), methods_for([8]), Settings(8, temperature=1.0, repeats=2, seed=4), index=2
    )
    for results in run.results.values():
        assert results[0].tokens == results[1].tokens


def fake_run(index: int, seconds: dict[str, list[float]], tokens: int = 10) -> PromptRun:
    """A prompt's results with chosen decode times (one per repeat) and identical outputs."""
    results = {}
    for scope, times in seconds.items():
        results[scope] = [
            DecodeResult(tokens=list(range(tokens)), acceptance_lengths=[1] * (tokens // 2), decode_seconds=t)
            for t in times
        ]
    return PromptRun(index, [1, 2, 3], 0.5, 0.1, results)


def test_medians_and_ranges_of_decode_speed_and_speedup() -> None:
    methods = methods_for([8])
    comparison = Comparison(methods, temperature=0.0, dtype=torch.float32)
    # Two prompts, three repeats. AR takes 1 s a prompt; DFlash 0.5, 0.25, 1.0 s; DDTree 0.2 s with one slow pass.
    for index in range(2):
        comparison.add(
            fake_run(index, {"ar": [1.0, 1.0, 2.0], "dflash": [0.5, 0.25, 1.0], "ddtree_tb8": [0.2, 0.2, 0.2]})
        )
    metrics = comparison.metrics()
    ar, dflash, ddtree = metrics["ar"], metrics["dflash"], metrics["ddtree_tb8"]
    assert ar["tokens_per_s"] == pytest.approx(10.0)  # repeats at 10, 10, 5 tokens/s: median 10
    assert (ar["tokens_per_s_min"], ar["tokens_per_s_max"]) == pytest.approx((5.0, 10.0))
    assert dflash["tokens_per_s"] == pytest.approx(20.0)
    assert (dflash["tokens_per_s_min"], dflash["tokens_per_s_max"]) == pytest.approx((10.0, 40.0))
    # speedups are paired within a repeat: 2, 4, 2 → median 2; DDTree 5, 5, 10 → median 5
    assert (dflash["speedup_vs_ar"], dflash["speedup_vs_ar_min"], dflash["speedup_vs_ar_max"]) == pytest.approx(
        (2.0, 2.0, 4.0)
    )
    assert (ddtree["speedup_vs_ar"], ddtree["speedup_vs_ar_max"]) == pytest.approx((5.0, 10.0))
    assert ddtree["tpot_ms"] == pytest.approx(1000 / ddtree["tokens_per_s"])
    # prefill: the target's 0.5 s for AR, and the drafter's 0.1 s more for drafting methods
    assert ar["prefill_ms"] == pytest.approx(500.0) and dflash["prefill_ms"] == pytest.approx(600.0)
    assert ar["lossless"] == dflash["lossless"] == 1.0 and ar["repeats"] == 3.0
    assert ar["near_tie_divergences"] == ar["unexplained_divergences"] == 0.0


def test_no_exactness_metrics_when_sampling() -> None:
    comparison = Comparison(methods_for([8]), temperature=0.7, dtype=torch.float32)
    comparison.add(fake_run(0, {"ar": [1.0], "dflash": [1.0], "ddtree_tb8": [1.0]}))
    assert all("lossless" not in m and "near_tie_divergences" not in m for m in comparison.metrics().values())


def test_tally_starts_empty() -> None:
    tally = MethodTally(methods_for([])[0])
    assert tally.metrics(tally, exactness=True)["tokens_per_s"] == 0.0


def varied_run(index: int, seconds: dict[str, list[float]], accepted: dict[str, int], tokens: int = 12) -> PromptRun:
    """A prompt's results (one per pass) where a method accepts `accepted[scope]` drafted tokens a round."""
    results = {}
    for scope, times in seconds.items():
        results[scope] = [
            DecodeResult(list(range(tokens)), lengths(accepted.get(scope, 0)), decode_seconds=t) for t in times
        ]
    return PromptRun(index, [1, 2, 3], 0.5, 0.1, results)


def lengths(accepted: int, tokens: int = 12) -> list[int]:
    """The rounds of a decode of `tokens` that accepts `accepted` drafted tokens a round (the last one fewer)."""
    whole, rest = divmod(tokens, accepted + 1)
    return [accepted] * whole + ([rest - 1] if rest else [])


# Per prompt: AR's seconds, DFlash's and DDTree's share of them, and their accepted tokens a round. The prompts
# differ in difficulty (AR's time) and in how well they draft; the second pass is 20 % slower for every method.
PROMPTS = ((1.0, 0.5, 0.3, 1, 3), (3.0, 0.6, 0.4, 2, 2), (0.5, 0.4, 0.25, 1, 5), (2.0, 0.55, 0.35, 3, 3),
           (1.5, 0.45, 0.32, 2, 4))  # fmt: skip
PASSES = (1.0, 1.2)


def _compare(prompts: tuple[tuple[float, float, float, int, int], ...], methods: list[Method]) -> dict[str, dict]:
    comparison = Comparison(methods, temperature=0.0, dtype=torch.float32)
    for index, (ar, dflash, ddtree, dflash_accepted, ddtree_accepted) in enumerate(prompts):
        share = {"ar": 1.0, "dflash": dflash, "ddtree": ddtree}
        seconds = {m.scope: [ar * share[m.name] * p for p in PASSES] for m in methods}
        accepted = {"dflash": dflash_accepted, "ddtree_tb8": ddtree_accepted}
        comparison.add(varied_run(index, seconds, accepted))
    return comparison.metrics()


def test_tau_and_the_speedups_have_a_bootstrap_interval_over_prompts() -> None:
    metrics = _compare(PROMPTS, methods_for([8]))
    ar, dflash, ddtree = metrics["ar"], metrics["dflash"], metrics["ddtree_tb8"]
    assert not any("_ci_" in key or "vs_dflash" in key for key in ar)  # AR's tau and speedup are 1 by definition
    assert "speedup_vs_dflash" not in dflash
    for figures, key in ((dflash, "tau"), (dflash, "speedup_vs_ar"), (ddtree, "tau"), (ddtree, "speedup_vs_ar")):
        assert figures[f"{key}_ci_low"] < figures[key] < figures[f"{key}_ci_high"], key
    # DDTree against DFlash: their seconds over all prompts, within each pass (equal here), then the median
    assert ddtree["speedup_vs_dflash"] == pytest.approx(
        sum(p[0] * p[1] for p in PROMPTS) / sum(p[0] * p[2] for p in PROMPTS)
    )
    assert ddtree["speedup_vs_dflash_ci_low"] < ddtree["speedup_vs_dflash"] < ddtree["speedup_vs_dflash_ci_high"]
    # the intervals lie within the per-prompt spread: each prompt's tau, its speedup over AR and over DFlash
    taus = [12 / len(lengths(p[4])) for p in PROMPTS]
    assert min(taus) <= ddtree["tau_ci_low"] and ddtree["tau_ci_high"] <= max(taus)
    over_ar, over_dflash = [1 / p[2] for p in PROMPTS], [p[1] / p[2] for p in PROMPTS]
    assert min(over_ar) <= ddtree["speedup_vs_ar_ci_low"] and ddtree["speedup_vs_ar_ci_high"] <= max(over_ar)
    assert min(over_dflash) <= ddtree["speedup_vs_dflash_ci_low"]
    assert ddtree["speedup_vs_dflash_ci_high"] <= max(over_dflash)
    assert _compare(PROMPTS, methods_for([8])) == metrics  # the same run, the same intervals


def test_under_five_prompts_have_no_interval_and_without_dflash_no_ratio_to_it() -> None:
    one = _compare(PROMPTS[:1], methods_for([8]))
    assert not any("_ci_" in key for figures in one.values() for key in figures)  # no spread to resample
    four = _compare(PROMPTS[:4], methods_for([8]))
    assert not any("_ci_" in key for figures in four.values() for key in figures)  # too few for a 95 % interval
    assert four["ddtree_tb8"]["prompts"] == 4
    assert one["ddtree_tb8"]["speedup_vs_dflash"] == pytest.approx(0.5 / 0.3)
    alone = _compare(PROMPTS, [Method("ar", "ar"), Method("ddtree_tb8", "ddtree", 8)])
    assert "speedup_vs_dflash" not in alone["ddtree_tb8"] and "tau_ci_low" in alone["ddtree_tb8"]
