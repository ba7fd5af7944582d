"""What a draft-tree node costs (`remote_worker.decoding.node_cost`) and experiment=node_cost on the tiny models."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from orchestrator.stream.events import split_events
from remote_worker import runner
from remote_worker.decoding import node_cost
from remote_worker.decoding.loop import decode_from, prefill
from remote_worker.decoding.node_cost import (
    SPREAD,
    NodeCosts,
    StageCost,
    context_tokens,
    measure_from,
    measure_node_costs,
    node_cost_sizes,
)
from remote_worker.events import EVENTS_FILE
from remote_worker.experiments.node_cost import NODE_COSTS_FILE
from remote_worker.models.dflash import DFlashDraft
from remote_worker.models.loading import load_drafter, load_model
from remote_worker.models.target import TargetModel
from tests import specs
from tests.tiny_models import model_spec, random_prompt, tiny

TEXT = torch.tensor(list(b"def mean(values):\n    return sum(values) / len(values)\n"))
SIZES = [1, 2, 4, 8]

# GDN axes all unequal, as in real checkpoints: 2 key heads read by 6 value heads (r=3), key dim 8, value dim 16.
UNEQUAL_AXES = {"linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 8}


def unequal_axes_pair() -> tuple[TargetModel, DFlashDraft]:
    spec = model_spec("tiny_hybrid", "float32")
    spec = dataclasses.replace(spec, config={**spec.config, **UNEQUAL_AXES})
    model = load_model(spec, seed=0)
    return TargetModel(model), load_drafter(spec, seed=0, target=model)


def pair(name: str) -> tuple[TargetModel, DFlashDraft]:
    return unequal_axes_pair() if name == "unequal_axes" else tiny(name)


def figures(cost: StageCost) -> tuple[float, float, float]:
    return cost.low_ms, cost.median_ms, cost.high_ms


@pytest.mark.worker
@pytest.mark.parametrize("name", ["tiny_trained", "tiny_dense", "unequal_axes"])
def test_every_stage_has_a_figure_per_tree_size(name: str) -> None:
    """A trained hybrid (deep trees: commits of several tokens), the dense control, and a hybrid whose GDN key
    and value axes all differ (key heads ≠ value heads, key dim ≠ value dim)."""
    target, drafter = pair(name)
    if name == "unequal_axes":
        _, _, hk, r, dk, dv = target.layout.gdn
        assert (hk, hk * r, dk, dv) == (2, 6, 8, 16)
    seen: list[tuple[int, int, str]] = []
    costs = measure_node_costs(target, drafter, TEXT, 20, SIZES, 3, lambda *args: seen.append(args), warmup=1)
    assert costs.sizes == SIZES and costs.unmeasured == [] and costs.note == ""
    assert (costs.context, costs.repeats, costs.warmup, costs.device) == (20, 3, 1, str(target.device))
    assert (costs.block_size, costs.accepted) == (drafter.block_size, drafter.block_size - 1)
    assert len(costs.tree) == len(costs.verify) == len(costs.commit) == len(costs.commit_depths) == len(SIZES)
    for cost in [costs.draft, *costs.tree, *costs.verify, *costs.commit]:
        low, median, high = figures(cost)
        assert all(math.isfinite(v) for v in (low, median, high))
        assert 0 <= low <= median <= high
    # The committed path is the tree's rank-0 chain: no deeper than the tree, nor than the draft's block.
    assert costs.commit_depths[0] == 0
    deepest = [min(n - 1, drafter.block_size - 1) for n in SIZES]
    assert all(1 <= d <= most for d, most in zip(costs.commit_depths[1:], deepest[1:], strict=True))
    assert costs.commit_depths == sorted(costs.commit_depths)
    if name == "tiny_trained":
        assert costs.commit_depths[-1] > 1  # a trained draft's tree goes deeper than one level
    # Progress in node-rounds (4 per size: 1 warm-up and 3 timed), the last call at the total.
    per_size = [done for done, _, what in seen if "verify" in what]
    assert per_size == [4 * sum(SIZES[: i + 1]) for i in range(len(SIZES))]
    assert {total for _, total, _ in seen} == {4 * sum(SIZES)} and seen[-1][0] == 4 * sum(SIZES)
    assert costs.round_ms(7) > costs.draft.median_ms


@pytest.mark.worker
def test_a_long_tree_size_sends_progress_between_its_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A size whose rounds take minutes is never silent: with the interval at 0, a call after every round."""
    monkeypatch.setattr(node_cost, "PROGRESS_EVERY_S", 0.0)
    target, drafter = pair("tiny_trained")
    seen: list[tuple[int, int, str]] = []
    measure_node_costs(target, drafter, TEXT, 20, [1, 8], 3, lambda *args: seen.append(args), warmup=1)
    assert [what for _, _, what in seen[:3]] == ["1 node: round 1/4", "1 node: round 2/4", "1 node: round 3/4"]
    assert [done for done, _, _ in seen] == [1, 2, 3, 4, 12, 20, 28, 36] and seen[-1][1] == 36


@pytest.mark.worker
def test_measuring_leaves_the_prefill_as_it_was() -> None:
    target, drafter = tiny("tiny_trained")
    start = prefill(target, context_tokens(TEXT, 30), drafter)
    kv, conv, recurrent = (t.clone() for t in (start.cache.kv, start.cache.conv, start.cache.recurrent))
    draft_kv = start.draft_context.buffer[:, :, :, : start.draft_context.length].clone()
    before = decode_from(target, start, method="ddtree", max_new_tokens=24, drafter=drafter, budget=8)
    measure_from(target, drafter, start, SIZES, 2, warmup=1)
    assert (start.cache.length, start.draft_context.length) == (30, 30)
    assert torch.equal(start.cache.kv, kv) and torch.equal(start.cache.conv, conv)
    assert torch.equal(start.cache.recurrent, recurrent)
    assert torch.equal(start.draft_context.buffer[:, :, :, :30], draft_kv)
    after = decode_from(target, start, method="ddtree", max_new_tokens=24, drafter=drafter, budget=8)
    assert after.tokens == before.tokens and after.acceptance_lengths == before.acceptance_lengths


@pytest.mark.worker
def test_sizes_the_draft_cannot_fill_are_listed_not_measured() -> None:
    """A block of 2 drafts one position: 512 distinct nodes below the root over tiny_hybrid's vocabulary."""
    target, drafter = tiny("tiny_hybrid")
    drafter.block_size = 2
    try:
        costs = measure_node_costs(target, drafter, random_prompt(1), 8, [1, 4, 600, 1000], 1, warmup=0)
        with pytest.raises(ValueError, match="no tree size could be measured: a tree of 600 nodes needs 599"):
            measure_node_costs(target, drafter, random_prompt(1), 8, [600], 1, warmup=0)
    finally:
        drafter.block_size = 8
    assert costs.sizes == [1, 4] and costs.unmeasured == [600, 1000]
    assert costs.note == (
        "a tree of 600 nodes needs 599 below its root; a draft block of 2 offers 512 (1 drafted position over a "
        "vocabulary of 512)"
    )
    assert costs.commit_depths == [0, 1] and costs.accepted == 1


def hand_built() -> NodeCosts:
    def stage(*medians: float) -> list[StageCost]:
        return [StageCost(m, m / 2, 2 * m) for m in medians]

    return NodeCosts(
        sizes=[1, 2, 4, 8],
        context=256,
        repeats=5,
        device="cpu",
        draft=StageCost(1.0, 0.9, 1.2),
        tree=stage(0.0, 0.5, 1.0, 2.0),
        verify=stage(10.0, 11.0, 13.0, 17.0),
        commit=stage(0.2, 0.3, 0.4, 0.6),
        block_size=8,
        accepted=7,
        commit_depths=[0, 1, 2, 3],
    )


@pytest.mark.worker
@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (0, 1.0 + 0.0 + 10.0 + 0.2),  # a measured size: its figures as they are
        (2, 1.0 + 0.75 + 12.0 + 0.35),  # 3 nodes: halfway between 2 and 4
        (4, 1.0 + 1.25 + 14.0 + 0.45),  # 5 nodes: a quarter of the way from 4 to 8
        (7, 1.0 + 2.0 + 17.0 + 0.6),  # the largest size measured
    ],
)
def test_a_round_is_the_stages_interpolated_linearly_in_nodes(budget: int, expected: float) -> None:
    assert hand_built().round_ms(budget) == pytest.approx(expected, abs=1e-12)


@pytest.mark.worker
def test_a_budget_outside_the_sizes_measured_has_no_round() -> None:
    costs = hand_built()
    assert costs.largest_budget == 7
    with pytest.raises(ValueError, match=r"^budget 8 is a tree of 9 nodes, outside the sizes measured \(1–8 nodes"):
        costs.round_ms(8)
    with pytest.raises(ValueError, match="budget -1 is a tree of 0 nodes"):
        costs.round_ms(-1)
    with pytest.raises(ValueError, match="verify has 3 costs for 4 sizes"):
        dataclasses.replace(costs, verify=costs.verify[:3])
    with pytest.raises(ValueError, match="must be increasing"):
        dataclasses.replace(costs, sizes=[1, 4, 2, 8])


@pytest.mark.worker
def test_the_record_reads_back_as_it_was_written() -> None:
    costs = dataclasses.replace(hand_built(), unmeasured=[16], note="why")
    record = json.loads(json.dumps(costs.as_record()))
    assert record["spread"] == SPREAD == "min-max"
    assert record["verify"][1] == {"median_ms": 11.0, "low_ms": 5.5, "high_ms": 22.0, "mean_ms": None}
    assert NodeCosts.from_record(record) == costs


@pytest.mark.worker
@pytest.mark.parametrize(
    ("budget", "cap", "sizes"),
    [
        (0, 256, [1]),
        (1, 256, [1, 2]),
        (15, 256, [1, 2, 4, 8, 16]),
        (16, 256, [1, 2, 4, 8, 16, 32]),
        (255, 256, [1, 2, 4, 8, 16, 32, 64, 128, 256]),
        (1000, 256, [1, 2, 4, 8, 16, 32, 64, 128, 256]),
        (1000, 1024, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]),
        (20, 24, [1, 2, 4, 8, 16, 24]),
        # the run's own sizes (cap: the largest budget's tree): no power of two a node below it
        (64, 65, [1, 2, 4, 8, 16, 32, 65]),
        (16, 17, [1, 2, 4, 8, 17]),
        (47, 48, [1, 2, 4, 8, 16, 32, 48]),  # half again: kept
        (40, 41, [1, 2, 4, 8, 16, 41]),
        (63, 64, [1, 2, 4, 8, 16, 32, 64]),
        (2, 3, [1, 2, 3]),
    ],
)
def test_sizes_double_up_to_what_the_largest_budget_needs(budget: int, cap: int, sizes: list[int]) -> None:
    assert node_cost_sizes(budget, cap) == sizes


@pytest.mark.worker
def test_the_context_is_the_prompt_repeated_and_cut() -> None:
    assert context_tokens(torch.tensor([5, 6, 7]), 7).tolist() == [5, 6, 7, 5, 6, 7, 5, 6]
    assert context_tokens(torch.tensor([5, 6, 7]), 1).tolist() == [5, 6]
    with pytest.raises(ValueError, match="context=0"):
        context_tokens(torch.tensor([5, 6, 7]), 0)


@pytest.mark.worker
def test_the_experiment_reports_a_curve_per_stage_and_the_record(tmp_path: Path) -> None:
    spec = specs.decode_spec(tmp_path, num_prompts=1)
    spec["experiment"] = {"name": "node_cost", "context": 24, "max_size": 8, "repeats": 2, "prompts": None}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert runner.run(tmp_path / "spec.json") == 0
    events, _ = split_events((tmp_path / EVENTS_FILE).read_bytes())
    end = events[-1]
    assert end.kind == "end" and end.data["status"] == "FINISHED", end.data
    metrics: dict[str, dict[int, float]] = {}
    for event in (e for e in events if e.kind == "metrics"):
        for key, value in event.data.items():
            metrics.setdefault(key, {})[event.step] = value
    for stage in ("verify", "tree", "commit"):
        for suffix in ("", "_low", "_high"):
            assert set(metrics[f"node_cost.{stage}_ms{suffix}"]) == set(SIZES)
    assert set(metrics["node_cost.draft_ms"]) == {0} and set(metrics["node_cost.round_ms"]) == set(SIZES)
    assert [e.data["path"] for e in events if e.kind == "artifact"] == [NODE_COSTS_FILE]
    costs = NodeCosts.from_record(json.loads((tmp_path / NODE_COSTS_FILE).read_text()))
    assert costs.sizes == SIZES and costs.context == 24 and costs.repeats == 2
    assert metrics["node_cost.verify_ms"][8] == costs.verify[-1].median_ms
    assert metrics["node_cost.round_ms"][4] == pytest.approx(costs.round_ms(3))
    params = {k: v for e in events if e.kind == "params" for k, v in e.data.items()}
    assert params["node_cost.context"] == 24 and params["node_cost.sizes"] == "1, 2, 4, 8"
    assert params["layout.gdn_key_value_heads"] == "2/4 (r=2)"
    measure = [e.data for e in events if e.kind == "progress" and e.data["task"] == "measure"]
    assert measure[-1]["completed"] == measure[-1]["total"] == sum(SIZES) * (node_cost.WARMUP + 2)  # node-rounds
    assert {m["total"] for m in measure} == {measure[-1]["total"]}
    summary = end.data["summary"]
    assert set(summary) >= {"measured", "draft", "tree build", "verify", "commit", "round at budget 7"}
    assert summary["verify"].startswith("1 node ") and " → 8 nodes " in summary["verify"]
    assert all(len(line) <= 50 for line in summary.values()), summary  # a row of an 80-column terminal


@pytest.mark.worker
def test_a_long_measurement_says_how_long_before_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate comes before the first timed round, with its basis, and the run records it beside what the
    measurement took (`node_cost.estimate_s`, `node_cost.measure_s`)."""
    from remote_worker.experiments import node_cost as experiment

    monkeypatch.setattr(experiment, "LONG_S", 0.0)  # every measurement counts as long here
    spec = specs.decode_spec(tmp_path, num_prompts=1)
    spec["experiment"] = {"name": "node_cost", "context": 24, "max_size": 64, "repeats": 2, "prompts": None}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert runner.run(tmp_path / "spec.json") == 0
    events, _ = split_events((tmp_path / EVENTS_FILE).read_bytes())
    said = [i for i, e in enumerate(events) if e.kind == "log" and "will take about" in e.data["message"]]
    timed = [
        i for i, e in enumerate(events) if e.kind == "progress" and e.data["task"] == "measure" and e.data["completed"]
    ]
    assert len(said) == 1 and timed and said[0] < timed[0]
    message = events[said[0]].data["message"]
    assert message.startswith(
        "warning: node_cost: measuring 7 tree sizes up to 64 nodes, 4 rounds each, will take about "
    )
    assert "one round took " in message and message.endswith("experiment.max_size sets the largest tree")
    params = {k: v for e in events if e.kind == "params" for k, v in e.data.items()}
    assert params["node_cost.estimate_s"] > 0 and params["node_cost.measure_s"] > 0


def composed(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    from orchestrator import CONF_DIR
    from orchestrator.config.validation import resolve_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return resolve_config(compose(config_name="config", overrides=overrides))


def test_the_experiment_and_its_settings_pass_validation() -> None:
    config = composed(["experiment=node_cost"])
    experiment = {"name": "node_cost", "context": 256, "max_size": 256, "repeats": 10, "prompts": None}
    assert config["experiment"] == experiment
    assert config["decode"]["node_costs"] is True and config["decode"]["node_cost_repeats"] == 5
    assert composed(["experiment=node_cost", "experiment.context=null"])["experiment"]["context"] is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["decode.node_costs=maybe"], "decode.node_costs='maybe' must be true or false"),
        (["decode.node_cost_repeats=0"], "decode.node_cost_repeats=0 must be an integer >= 1"),
        (["decode.node_cost_repeats=1.5"], "decode.node_cost_repeats=1.5 must be an integer >= 1"),
        (["decode.node_cost_repeats=1001"], "decode.node_cost_repeats must be at most 1000"),
        (
            ["experiment=node_cost", "experiment.context=0"],
            "experiment.context=0 must be null (the prompt's own length) or an integer >= 1",
        ),
        (["experiment=node_cost", "experiment.max_size=0"], "experiment.max_size=0 must be an integer >= 1"),
        (["experiment=node_cost", "experiment.repeats=1001"], "experiment.repeats must be at most 1000"),
        (
            ["experiment=node_cost", "experiment.context=2045"],
            "experiment.context=2045 and a draft block of 8 need 2053 positions, more than model tiny_trained's "
            "context of 2048",
        ),
    ],
)
def test_bad_node_cost_settings_give_one_line_naming_the_key(overrides: list[str], message: str) -> None:
    from orchestrator.config.validation import ConfigError

    with pytest.raises(ConfigError) as err:
        composed(overrides)
    assert str(err.value) == message
