"""`ddtree_online` (`decoding/online_budget.py`): the budget a round verifies, chosen among the allowed sizes from
the calibrated path probabilities and the host's costs; the calibration against a drafter whose confidences are
known; the prefix of the largest tree as the tree of the chosen budget. Exactness at T = 0 on every tiny model
and every published layout's twin is `tests/lossless.py`'s (it decodes `ddtree_online` beside the budgets)."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from remote_worker.decoding.online_budget import (
    BINS,
    PRIOR,
    WARMUP_ROUNDS,
    Calibration,
    OnlineBudget,
    depth_bucket,
    probability_bin,
)
from remote_worker.decoding.tree_build import best_first_tree, prefix_tree
from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
from remote_worker.spec import parse_spec
from tests.specs import decode_spec


def random_tree(seed: int, budget: int, sharp: float) -> object:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(15, 64, generator=generator) * sharp
    return best_first_tree(7, logits, budget)


def test_the_largest_trees_prefix_is_the_tree_of_the_smaller_budget() -> None:
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(15, 64, generator=generator) * (1 + seed % 4)
        large = best_first_tree(3, logits, 96)
        for budget in (1, 5, 17, 64, 96):
            small, cut = best_first_tree(3, logits, budget), prefix_tree(large, budget)
            assert cut.tree.tokens.tolist() == small.tree.tokens.tolist()
            assert cut.tree.parents.tolist() == small.tree.parents.tolist()
            assert cut.scores == small.scores and cut.ranks == small.ranks and cut.children == small.children


def test_the_chosen_budget_is_always_one_of_the_sizes_and_the_fast_choice_is_the_naive_one() -> None:
    rng = random.Random(0)
    for case in range(300):
        sizes = tuple(sorted(rng.sample([1, 2, 4, 8, 16, 24, 32, 48, 64], rng.randint(1, 5))))
        slope, fixed_ms = rng.uniform(0, 0.2), rng.uniform(0.5, 5)
        online = OnlineBudget(64, sizes, sizes[0], lambda n, s=slope, f=fixed_ms: f + s * n)
        for _ in range(rng.randint(0, 3)):  # some history, some of it wrong
            tree = random_tree(rng.randrange(10**6), 64, rng.uniform(0.5, 6))
            online.observe(tree, [0, *range(1, rng.randint(1, 4))])
        online.calibration.rounds += WARMUP_ROUNDS
        tree = random_tree(case, rng.choice([8, 40, 64]), rng.uniform(0.5, 6))
        chosen = online.choose(tree)
        assert chosen == online.choose_naive(tree)
        grown = tree.tree.size - 1
        assert chosen in sizes or (chosen == grown and grown < sizes[0])
        assert chosen <= grown


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


def test_calibration_converges_to_a_drafter_whose_confidences_are_known() -> None:
    """A synthetic drafter that is right as often as it says near the root and overconfident deep down (at
    depth d >= 4 a node it predicts at p is accepted with probability p / 2): the calibrated probabilities
    converge to the true ones, within the binomial error of each bin's observations."""
    rng = random.Random(7)

    def truth(p: float, depth: int) -> float:
        return p if depth < 4 else p / 2

    calibration = Calibration()
    true_sum: dict[tuple[int, int], float] = {}
    for _ in range(4000):
        probabilities = [rng.random() for _ in range(12)]
        depths = [rng.randint(1, 10) for _ in range(12)]
        accepted = {
            i for i, (p, d) in enumerate(zip(probabilities, depths, strict=True), 1) if rng.random() < truth(p, d)
        }
        calibration.observe(probabilities, depths, accepted)
        for p, d in zip(probabilities, depths, strict=True):
            key = (depth_bucket(d), probability_bin(p))
            true_sum[key] = true_sum.get(key, 0.0) + truth(p, d)
    for key, seen in calibration.seen.items():
        p_mid = (key[1] + 0.5) / BINS
        depth = (1, 2, 3, 4, 6, 9)[key[0]]
        expected = true_sum[key] / seen  # the mean true probability of the nodes the bin saw
        # 5 standard errors of a share of `seen` draws, and the prior's pull toward p (at most PRIOR / seen)
        bound = 5 * math.sqrt(0.25 / seen) + PRIOR / (seen + PRIOR)
        assert abs(calibration.calibrated(p_mid, depth) - expected) <= bound, (key, seen)
    deep_sure = calibration.calibrated(0.95, 6)
    assert deep_sure < 0.6  # overconfidence corrected: the raw 0.95 is far off
    curve = calibration.as_record()
    assert {row["depths"] for row in curve} == {"1", "2", "3", "4-5", "6-8", "9+"}
    assert all(0 <= row["accepted"] <= 1 and row["nodes"] > 0 for row in curve)


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
    run_ddtree_gdn(parse_spec(raw, run_dir), EventLog(run_dir))
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
