"""`ddtree_online` (`decoding/online_budget.py`): the budget a round verifies, chosen among the allowed sizes from
the calibrated path probabilities and the host's costs; the calibration against a drafter whose confidences are
known; the prefix of the largest tree as the tree of the chosen budget. Exactness at T = 0 on every tiny model
and every published layout's twin is `tests/lossless.py`'s (it decodes `ddtree_online` beside the budgets)."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from bench.online_replay import ReplayRound, _oracle, _rate, record_rounds
from orchestrator.tracking.job_summary import online_line, summarize
from orchestrator.tracking.plots import plot_decode_summary
from remote_worker.decoding.loop import decode_from, prefill
from remote_worker.decoding.online_budget import (
    BINS,
    PRIOR,
    WARMUP_ROUNDS,
    Calibration,
    OnlineBudget,
    depth_bucket,
    probability_bin,
)
from remote_worker.decoding.tree_build import Growth, best_first_tree, grow_best_first
from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
from remote_worker.spec import parse_spec
from tests.specs import decode_spec
from tests.teacher_drafter import TeacherDrafter
from tests.tiny_models import random_prompt, tiny


def random_tree(seed: int, budget: int, sharp: float) -> Growth:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(15, 64, generator=generator) * sharp
    return grow_best_first(7, logits, budget)


def test_the_largest_trees_prefix_is_the_tree_of_the_smaller_budget() -> None:
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(15, 64, generator=generator) * (1 + seed % 4)
        large = grow_best_first(3, logits, 96)  # the heap at width 96; the small trees grow at their own width
        for budget in (1, 5, 17, 64, 96):
            small = best_first_tree(3, logits, budget)
            for cut in (large.first(budget), large.prefix(budget).first(96)):
                assert cut.tree.tokens.tolist() == small.tree.tokens.tolist()
                assert cut.tree.parents.tolist() == small.tree.parents.tolist()
                assert cut.tree.depths.tolist() == small.tree.depths.tolist()
                assert cut.scores == small.scores and cut.ranks == small.ranks and cut.children == small.children


def test_the_chosen_budget_is_always_one_of_the_sizes_and_the_fast_choice_is_the_naive_one() -> None:
    rng = random.Random(0)
    for case in range(300):
        sizes = tuple(sorted(rng.sample([1, 2, 4, 8, 16, 24, 32, 48, 64], rng.randint(1, 5))))
        slope, fixed_ms = rng.uniform(0, 0.2), rng.uniform(0.5, 5)
        online = OnlineBudget(64, sizes, sizes[0], lambda n, s=slope, f=fixed_ms: f + s * n)
        if case % 2:  # growing costs too: a round's cost depends on how far its tree grew
            growing = rng.uniform(0, 0.05)
            online.tree_ms = lambda nodes, g=growing: g * nodes
        for _ in range(rng.randint(0, 3)):  # some history, some of it wrong
            tree = random_tree(rng.randrange(10**6), 64, rng.uniform(0.5, 6)).first(rng.choice(sizes))
            online.observe(tree, tree.tree.path_to(rng.randrange(tree.tree.size)))
        online.calibration.rounds += WARMUP_ROUNDS
        tree = random_tree(case, rng.choice([8, 40, 64]), rng.uniform(0.5, 6))
        chosen = online.choose(tree)
        assert chosen == online.choose_naive(tree)
        assert chosen in sizes or (chosen == tree.nodes and tree.nodes < sizes[0])
        assert chosen <= tree.nodes


def test_a_fixed_budget_until_the_history_and_the_costs_exist() -> None:
    tree = random_tree(1, 64, 8.0)  # a confident draft: a large budget would be chosen
    online = OnlineBudget(64, (4, 16, 64), 16)
    assert online.choose(tree) == 16  # no costs yet
    online.cost_ms = lambda n: 1.0  # nodes cost nothing: the most nodes
    online.calibration.rounds = WARMUP_ROUNDS - 1
    assert online.choose(tree) == 16
    online.calibration.rounds = WARMUP_ROUNDS
    assert online.choose(tree) == 64
    online.cost_ms = lambda n: 1.0 + n  # nodes cost as much as a round: the fewest
    assert online.choose(tree) == 4


def test_a_round_grows_further_only_after_one_that_verified_all_it_grew() -> None:
    """`grow_to`: the fixed budget until the policy is ready; then, after a round that verified all it grew, the
    smallest size of at least twice its budget (the largest where none is): a round that chose the most it could
    see sees further next; after one that verified less, that budget again: it looked, and goes back."""
    online = OnlineBudget(64, (4, 16, 32, 64), 16)
    assert online.grow_to() == 16  # not ready
    online.cost_ms, online.calibration.rounds = (lambda n: 1.0), WARMUP_ROUNDS
    assert online.grow_to() == 4  # nothing verified yet: the smallest size
    tree = random_tree(1, 64, 8.0)
    for grown, chosen in ((4, 4), (16, 16), (32, 32), (64, 64), (64, 64)):
        assert online.grow_to() == grown
        assert online.choose(tree.prefix(grown)) == chosen  # nodes cost nothing: the most it can see
        online.observe(tree.first(chosen), [0])
    online.cost_ms = lambda n: 1.0 + n  # nodes cost as much as a round: the fewest
    assert online.choose(tree.prefix(online.grow_to())) == 4 and online.observe(tree.first(4), [0]) is None
    assert online.grow_to() == 4  # it verified 4 of the 64 it grew: no further than 4
    assert online.choose(tree.prefix(4)) == 4 and online.observe(tree.first(4), [0]) is None
    assert online.grow_to() == 16  # all it grew: further, and twice 4 is no size, so the next one
    online.cost_ms = lambda n: {4: 1.0, 16: 1.2}[n]
    assert online.choose(tree.prefix(16)) == 16 and online.observe(tree.first(16), [0]) is None
    assert online.grow_to() == 32


def test_calibration_converges_to_a_drafter_whose_confidences_are_known() -> None:
    """A synthetic drafter that is right as often as it says near the root and overconfident deep down (at
    depth d >= 4 a step it guesses at q is accepted with probability q / 2): the calibrated chances converge
    to the true ones, within the binomial error of each bin's observations."""
    rng = random.Random(7)

    def truth(q: float, depth: int) -> float:
        return q if depth < 4 else q / 2

    calibration = Calibration()
    true_sum: dict[tuple[int, int], float] = {}
    seen: dict[tuple[int, int], int] = {}
    for _ in range(4000):
        guesses = [rng.random() for _ in range(12)]
        depths = [rng.randint(1, 10) for _ in range(12)]
        accepted = [rng.random() < truth(q, d) for q, d in zip(guesses, depths, strict=True)]
        calibration.observe(guesses, depths, accepted)
        for q, d in zip(guesses, depths, strict=True):
            key = (depth_bucket(d), probability_bin(q))
            true_sum[key] = true_sum.get(key, 0.0) + truth(q, d)
            seen[key] = seen.get(key, 0) + 1
    assert sum(calibration.seen) == 4000 * 12 and calibration.rounds == 4000
    for key, count in seen.items():
        q_mid = (key[1] + 0.5) / BINS
        depth = (1, 2, 3, 4, 6, 9)[key[0]]
        expected = true_sum[key] / count  # the mean true chance of the steps the bin saw
        # 5 standard errors of a share of `count` draws, and the prior's pull toward q (at most PRIOR / count)
        bound = 5 * math.sqrt(0.25 / count) + PRIOR / (count + PRIOR)
        assert abs(calibration.calibrated(q_mid, depth) - expected) <= bound, (key, count)
    deep_sure = calibration.calibrated(0.95, 6)
    assert deep_sure < 0.6  # overconfidence corrected: the raw 0.95 is far off
    curve = calibration.as_record()
    assert {row["depths"] for row in curve} == {"1", "2", "3", "4-5", "6-8", "9+"}
    assert all(0 <= row["accepted"] <= 1 and row["nodes"] > 0 for row in curve)


def test_a_round_teaches_only_the_steps_whose_parent_was_accepted() -> None:
    """The accepted path 0 → 1 → 3: the root's children and node 1's children are steps the target judged;
    a child of a rejected node says nothing (its parent never was accepted)."""
    grown = random_tree(3, 24, 2.0)
    draft = grown.first(24)
    parents = draft.tree.parents.tolist()
    path = draft.tree.path_to(max(i for i in range(1, 25) if draft.tree.depths[i] == 2))
    online = OnlineBudget(64, (8, 24), 8)
    online.observe(draft, path)
    judged = [i for i in range(1, 25) if parents[i] in path]
    assert sum(online.calibration.seen) == len(judged) < 24
    assert sum(online.calibration.accepted) == len(path) - 1
    assert online.verified == {24: 1}


@pytest.mark.parametrize(
    ("sizes", "fixed", "message"),
    [((), 1, "sizes () must be increasing"), ((4, 2), 2, "must be increasing"), ((2, 4), 3, "the fixed budget 3")],
)
def test_bad_sizes_are_refused(sizes: tuple[int, ...], fixed: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        OnlineBudget(8, sizes, fixed)


@pytest.mark.worker
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_decode_run_reports_ddtree_online_like_every_method(tmp_path: Path, temperature: float) -> None:
    """`decode.online_budget=true`: a child run `ddtree_online` beside the fixed budgets, exact at T = 0, its
    chosen budgets per round as a histogram (`rounds_at_budget`, step = budget) and its calibration curve in the
    summary; the costs come from the run's own node-cost slices."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    raw = decode_spec(run_dir, num_prompts=2, max_new_tokens=20, tree_budgets=[4, 16], temperature=temperature,
                      compile=False, online_budget=True, node_cost_repeats=1)  # fmt: skip
    terminal = run_ddtree_gdn(parse_spec(raw, run_dir), EventLog(run_dir))
    summary = json.loads((run_dir / "decode_summary.json").read_text())
    scopes = {m["scope"]: m for m in summary["methods"]}
    assert set(scopes) == {"ar", "dflash", "ddtree_tb4", "ddtree_tb16", "ddtree_online"}
    online = scopes["ddtree_online"]
    assert online["method"] == "ddtree_online" and online["tree_budget"] == 16 and "speedup_vs_dflash" in online
    if temperature == 0:
        assert online["lossless"] == 1.0
    record = summary["online_budget"]["ddtree_online"]
    assert record["sizes"] == [1, 2, 4, 8, 16] and record["fixed"] == 16 and record["costs"] is True
    rounds = {int(n): count for n, count in record["rounds_at_budget"].items()}
    assert set(rounds) <= set(record["sizes"]) and sum(rounds.values()) >= 2
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    histogram = {
        e["step"]: e["data"]["rounds_at_budget"]
        for e in events
        if e["kind"] == "metrics" and e.get("scope") == "ddtree_online" and "rounds_at_budget" in e["data"]
    }
    assert histogram == {n: float(count) for n, count in rounds.items()}
    assert record["calibration"] and all(0 <= row["accepted"] <= 1 for row in record["calibration"])
    # set against the fixed budget that decoded fastest (one pass: the ratio of the two speeds), said plainly
    fastest = max((scopes[s] for s in ("ddtree_tb4", "ddtree_tb16")), key=lambda m: m["tokens_per_s"])
    assert online["best_fixed_budget"] == fastest["tree_budget"]
    assert online["speedup_vs_best_fixed"] == pytest.approx(online["tokens_per_s"] / fastest["tokens_per_s"])
    assert "speedup_vs_best_fixed_ci_low" not in online  # two prompts: no interval
    description = summarize(summary, "job").markdown
    said = (f"**DDTree-online** ran ×{online['speedup_vs_best_fixed']:.2f} the speed of DDTree-"
            f"{fastest['tree_budget']}, the fastest fixed budget here (picked after the fact): too few prompts to "
            "tell (an interval needs 5).")  # fmt: skip
    assert said in description.splitlines()
    assert terminal["online"] == "ddtree_online " + said.removeprefix("**DDTree-online** ").removesuffix(".")
    plots = {path.name: path for path in plot_decode_summary(run_dir / "decode_summary.json", tmp_path)}
    assert plots["ddtree_online.png"].stat().st_size > 10_000


def test_the_online_line_says_ahead_or_behind_only_beyond_the_interval() -> None:
    def line(low: float, high: float) -> str:
        method = {"method": "ddtree_online", "speedup_vs_best_fixed": (low + high) / 2, "best_fixed_budget": 32.0,
                  "speedup_vs_best_fixed_ci_low": low, "speedup_vs_best_fixed_ci_high": high}  # fmt: skip
        return online_line([method])

    assert line(0.91, 1.03).endswith("(0.91–1.03) the speed of DDTree-32, the fastest fixed budget here (picked "
                                     "after the fact): level with it within the 95 % interval.")  # fmt: skip
    assert line(0.85, 0.95).endswith("behind it beyond the 95 % interval.")
    assert line(1.02, 1.10).endswith("ahead of it beyond the 95 % interval.")
    assert online_line([{"method": "ddtree", "speedup_vs_best_fixed": 1.0}]) == ""


def _round(path: list[int]) -> ReplayRound:
    return ReplayRound(random_tree(0, 8, 1.0), path)


def test_the_replays_oracle_is_the_best_assignment_of_budgets_to_rounds() -> None:
    """`_oracle` (Dinkelbach over per-round choices) equals the brute-force best tokens per millisecond over
    every assignment of sizes to rounds, and is never below a fixed budget's."""
    rng = random.Random(3)
    sizes = (1, 2, 4, 8)
    for _ in range(40):
        rounds = [_round([0, *sorted(rng.sample(range(1, 9), rng.randint(0, 4)))]) for _ in range(4)]
        slope = rng.uniform(0.01, 2)
        cost = lambda n, s=slope: 1 + s * n  # noqa: E731
        brute = max(
            sum(r.accepted(n) + 1 for r, n in zip(rounds, chosen, strict=True)) / sum(cost(n) for n in chosen)
            for chosen in itertools.product(sizes, repeat=len(rounds))
        )
        assert _oracle(rounds, sizes, cost) == pytest.approx(brute, rel=1e-12)
        assert all(_oracle(rounds, sizes, cost) >= _rate(rounds, [n] * 4, cost) for n in sizes)


@pytest.mark.worker
def test_a_replayed_round_accepts_what_a_round_at_each_budget_accepts() -> None:
    """The replay's premise (the prefix property at T = 0): a round recorded at the largest budget tells what a
    round at any smaller budget accepts from the same state. Each record's first round, decoded for real at
    every budget, accepts `accepted(budget)` drafted tokens."""
    target, _ = tiny("tiny_hybrid", "float32")
    checked = 0
    for seed in range(3):
        prompt = random_prompt(seed)
        ar = decode_from(target, prefill(target, prompt), method="ar", max_new_tokens=24)
        teacher = TeacherDrafter(prompt.tolist() + ar.tokens, target.embed.num_embeddings, 8, seed)
        first = record_rounds(target, teacher, [prompt], 16, 0.0, 24)[0]
        for budget in (1, 2, 3, 5, 8, 16):
            result = decode_from(target, prefill(target, prompt, teacher), method="ddtree", budget=budget,
                                 drafter=teacher, max_new_tokens=24)  # fmt: skip
            assert result.acceptance_lengths[0] == first.accepted(budget), (seed, budget)
            checked += first.accepted(budget) >= 2
    assert checked  # some round accepted a path of two tokens or more


def test_a_guess_that_is_not_a_number_is_binned_not_raised() -> None:
    """A drafter's NaN or infinite logits make NaN guesses: they are binned at an end, the round verifies the
    fixed budget and the calibration learns nothing from them, so the decode goes on (its tokens are the target's
    whatever the draft says) and its curve stays numbers."""
    assert [probability_bin(q) for q in (math.nan, math.inf, -0.0, 0.05, 0.999, 1.0, 1.0000001)] == [
        0,
        9,
        0,
        0,
        9,
        9,
        9,
    ]
    grown = random_tree(2, 16, 2.0)
    broken = Growth(grown.tokens, grown.parents, [0.0, *([math.nan] * grown.nodes)], grown.depths, grown.ranks)
    online = OnlineBudget(16, (4, 16), 4, lambda n: 1.0 + n / 16)
    online.calibration.rounds = WARMUP_ROUNDS
    assert online.choose(broken) == online.choose_naive(broken) == 4  # the fixed budget
    online.observe(broken.first(16), [0])
    assert sum(online.calibration.seen) == 0 and online.calibration.rounds == WARMUP_ROUNDS + 1  # nothing learnt
    assert all(math.isfinite(row["predicted"]) for row in online.calibration.as_record())
