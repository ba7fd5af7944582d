"""The decode experiment's budget answer: the round costs measured in slices between the prompts, tau at every
budget from the DDTree decodes, the prediction built from both and checked against the decoded budgets
(`decoding.budget_choice`), and the curves the job's page draws.

The pieces live in `decoding` (`node_cost`, `round_times`, `budget_curve`, `budget_choice`, `tree_memory`);
this module is what the experiment calls between them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from remote_worker import stop_signal
from remote_worker.decoding.budget_choice import Measured, Prediction, RoundCosts, predict
from remote_worker.decoding.budget_curve import BudgetCurve, compare, curve_record, held_out_tau, nearest_tau
from remote_worker.decoding.comparison import Method, Settings
from remote_worker.decoding.compiled import CompiledRounds
from remote_worker.decoding.loop import prefill
from remote_worker.decoding.node_cost import NodeCosts, NodeCostSampler, context_tokens, metric_steps, node_cost_sizes
from remote_worker.decoding.round_times import RoundTimes, RoundTimeSampler
from remote_worker.decoding.tree_limits import beyond_draft
from remote_worker.decoding.tree_memory import budget_problem, tree_memory
from remote_worker.events import EventLog
from remote_worker.figures import rounded
from remote_worker.models.target import TargetModel
from remote_worker.spec import Spec

LOG = logging.getLogger(__name__)
MB = 1 << 20

# Prompts after which the costs are measured (evenly spaced), at most: enough samples to see the machine as
# the decodes do, without costing a long prompt set a measurement per prompt.
NODE_COST_POINTS = 8
# New tokens per sample of a compiled round: a few rounds each (AR's 8, a DDTree's 2–3), so that a slice costs
# about what an eager slice does, not the decode again (half of 64 tokens × 6 samples × every method was
# three times the decode of 8 prompts); at most the rest of the new tokens, which the rounds' capacity holds.
SAMPLE_TOKENS = 8


@dataclass
class NodeCostSlices:
    """`decode.node_costs`: the round's costs, measured in slices after some of the prompts (`after`), each at
    that prompt's context halfway through its decode (the prompt and half the new tokens),
    `decode.node_cost_repeats` rounds per size and slice. Slices between the decodes see the machine as the
    decodes did, where a measurement all before them saw whatever speed the machine had then
    (`NodeCostSampler`).

    The rounds measured are the ones the run decodes: the reference round's stages at every tree size up to
    the largest budget's (`node_cost`), or the run's compiled rounds timed whole (`round_times`)."""

    sampler: NodeCostSampler | RoundTimeSampler
    points: set[int]  # prompt indices after which a slice is measured
    repeats: int
    half: int  # half the new tokens: where an average round of a decode verifies
    tokens: int  # new tokens each compiled sample decodes from there (`SAMPLE_TOKENS`, within the rest)

    @classmethod
    def of(
        cls,
        spec: Spec,
        target: TargetModel,
        drafter: Any,
        prompts: int,
        settings: Settings,
        budgets: list[int],
        compiled: CompiledRounds | None = None,
    ) -> NodeCostSlices | None:
        if not spec.decode.get("node_costs", True):
            return None
        points = {round(k * (prompts - 1) / max(NODE_COST_POINTS - 1, 1)) for k in range(NODE_COST_POINTS)}
        repeats = int(spec.decode.get("node_cost_repeats", 5))
        sampler: NodeCostSampler | RoundTimeSampler
        if compiled is not None:
            sampler = RoundTimeSampler(target, drafter, compiled.rounds)
        else:
            largest = max(budgets)
            sampler = NodeCostSampler(target, drafter, node_cost_sizes(largest, cap=largest + 1))
        half = settings.max_new_tokens // 2
        return cls(sampler, points, repeats, half, max(min(settings.max_new_tokens - half, SAMPLE_TOKENS), 1))

    def after(self, index: int, ids: torch.Tensor, log: EventLog) -> None:
        """A slice after prompt `index` (its token ids), when it is one of the points."""
        if index not in self.points:
            return
        sampler = self.sampler
        slices = sorted(self.points)

        def progress(done: int, total: int, what: str) -> None:
            stop_signal.check()
            log.progress("node costs", slices.index(index) * total + done, len(slices) * total, what)

        start = prefill(sampler.target, context_tokens(ids, len(ids) - 1 + self.half), sampler.drafter)
        if isinstance(sampler, RoundTimeSampler):
            sampler.measure(start, self.tokens, self.repeats, progress)
        else:
            sampler.measure(start, self.repeats, warmup=1, progress=progress)

    def costs(self) -> NodeCosts | RoundTimes:
        costs = self.sampler.costs()
        if isinstance(costs, NodeCosts) and costs.unmeasured:
            LOG.warning("node costs: tree sizes %s not measured: %s", costs.unmeasured, costs.note)
        return costs


def budget_curve_record(
    methods: list[Method], curves: dict[str, BudgetCurve], summary: dict[str, dict[str, float]]
) -> dict[str, Any] | None:
    """tau at every budget from the largest budget's decode (`budget_curve`), checked against the run's real
    decodes at the other budgets; None without a DDTree method."""
    trees = [m for m in methods if m.name == "ddtree"]
    if not trees:
        return None
    largest = max(trees, key=lambda m: m.budget)
    curve = curves[largest.scope]
    checks = compare(curve, {m.budget: summary[m.scope]["tau"] for m in trees if m is not largest})
    return curve_record(largest.scope, curve, checks)


def predict_budget(
    methods: list[Method],
    curves: dict[str, BudgetCurve],
    costs: RoundCosts | None,
    summary: dict[str, dict[str, float]],
    *,
    compiled: bool,
    target: TargetModel | None = None,
    context: int = 0,
    free: int | None = None,
    prompts: int | None = None,
    measured_by: str = "the run",
) -> Prediction | None:
    """tokens/s predicted at every budget and checked (`budget_choice`); None without DDTree decodes and costs,
    or where they cannot predict (a warning says why: the decode's own figures are not to be lost to it).
    With `target`, each budget's tree memory is counted at `context` tokens and must fit `free` bytes."""
    trees = [m for m in methods if m.name == "ddtree"]
    if not trees or costs is None:
        return None
    by_budget = {m.budget: curves[m.scope] for m in trees}
    measured = [Measured(m.budget, summary[m.scope]["tokens_per_s"], summary[m.scope]["speedup_vs_ar"]) for m in trees]
    drafting = [metrics["speedup_vs_ar"] for scope, metrics in summary.items() if scope != methods[0].scope]
    tau = nearest_tau(by_budget)
    memory = None
    if target is not None:
        memory = [tree_memory(target, b + 1, context).total / MB for b in range(1, len(tau) + 1)]
    try:
        return predict(
            tau,
            {b: held_out_tau(by_budget, b) for b in by_budget},
            costs,
            summary[methods[0].scope]["tokens_per_s"],
            measured,
            run_kind="compiled" if compiled else "eager",
            drafting_slower=bool(drafting) and all(s < 1 for s in drafting),
            tree_memory_mb=memory,
            free_mb=free / MB if free is not None else None,
            prompts=prompts,
            measured_by=measured_by,
        )
    except ValueError as exc:
        LOG.warning("no predicted budget: %s", exc)
        return None


def emit_budget_curves(
    log: EventLog, curve: dict[str, Any] | None, costs: RoundCosts | None, prediction: Prediction | None
) -> None:
    """The job's curves, each a metric history whose step is the budget (or the tree size): `tau_at_budget`,
    `tau_at_budget_error` (estimate − measured, at the budgets the run decoded), the node costs
    (`node_cost.verify_ms` …, step = nodes; a compiled run's `round_cost.round_ms`), `predicted_tokens_per_s`,
    `prediction_error` (at the decoded budgets) and `tree_memory_mb`."""
    if curve is not None:
        for budget, tau in enumerate(curve["tau"], start=1):
            log.emit("metrics", rounded({"tau_at_budget": tau}), step=budget)
        for check in curve["checks"]:
            log.emit("metrics", rounded({"tau_at_budget_error": check["error"]}), step=check["budget"])
    if isinstance(costs, NodeCosts):
        for step, metrics in metric_steps(costs):
            log.emit("metrics", rounded(metrics), step=step)
    elif isinstance(costs, RoundTimes):
        for size, cost in zip(costs.sizes, costs.rounds, strict=True):
            log.emit("metrics", rounded({"round_cost.round_ms": cost.average_ms}), step=size)  # the mean: what predicts
    if prediction is not None:
        for index, budget in enumerate(prediction.budgets):
            figures = {"predicted_tokens_per_s": prediction.tokens_per_s[index]}
            if prediction.tree_memory_mb:
                figures["tree_memory_mb"] = prediction.tree_memory_mb[index]
            log.emit("metrics", rounded(figures), step=budget)
        for check in prediction.checks:
            log.emit("metrics", rounded({"prediction_error": check.error}), step=check.budget)


def check_budgets(target: TargetModel, block_size: int, budgets: list[int], context: int, free: int | None) -> None:
    """A budget a draft block cannot fill (`tree_limits`), or whose tree the device cannot hold
    (`tree_memory`), is one line before any decode, not a misnamed run or an allocator's error mid-sweep."""
    for budget in sorted(budgets, reverse=True):
        problem = beyond_draft(budget, block_size, target.head.out_features)
        problem = problem or budget_problem(target, budget, context, free)
        if problem is not None:
            raise ValueError(problem)
