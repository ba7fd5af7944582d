"""`experiment=ddtree_gdn`: AR, DFlash and DDTree at every tree budget over a prompt set, one child run each.

Target and draft are loaded once and every prompt is encoded (and checked against the model's context)
before anything is decoded. Each prompt is then prefilled once and decoded by every method from that
state, `decode.repeats` times, the methods taking turns (see `remote_worker.decoding.comparison`). At the
end each method reports its figures, then its per-round acceptance series, under its own scope (`ar`,
`dflash`, `ddtree_tb32`, …); while it runs, progress events carry its tau and speed so far.
`generations.jsonl` holds a row per prompt with every method's output; `decode_summary.json` carries what
the orchestrator plots.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from remote_worker import stop_signal
from remote_worker.decoding.acceptance_profile import AcceptanceProfile
from remote_worker.decoding.budget_choice import Measured, Prediction, predict
from remote_worker.decoding.budget_curve import BudgetCurve, compare, curve_record
from remote_worker.decoding.comparison import (
    AR_BY_DEFINITION,
    Comparison,
    Method,
    PromptRun,
    Settings,
    methods_for,
    run_prompt,
)
from remote_worker.decoding.compile_cache import CompileCache
from remote_worker.decoding.compiled import CompiledRounds, compile_rounds, wanted
from remote_worker.decoding.divergence import Divergence
from remote_worker.decoding.loop import prefill
from remote_worker.decoding.node_cost import NodeCosts, NodeCostSampler, context_tokens, metric_steps, node_cost_sizes
from remote_worker.decoding.tree_limits import beyond_draft
from remote_worker.decoding.tree_memory import budget_problem, free_bytes
from remote_worker.events import EventLog
from remote_worker.models.layout import layout_params
from remote_worker.models.loading import (
    context_length,
    load_drafter,
    load_model,
    load_tokenizer,
    model_prompts,
    stop_token_ids,
)
from remote_worker.models.target import TargetModel
from remote_worker.prompt_set import DEFAULT_PROMPTS, Prompt, load_prompt_file
from remote_worker.prompts import decode_text, encode
from remote_worker.spec import Spec

LOG = logging.getLogger(__name__)
SUMMARY_FILE = "decode_summary.json"
GENERATIONS_FILE = "generations.jsonl"


def prompt_source(spec: Spec) -> Path:
    """The run's own copy of its prompt set when the orchestrator sent one, else the prompts the checkpoint
    ships (a trained fixture's held-out set), else the small set shipped with the worker."""
    if spec.experiment.get("prompts_file"):
        return spec.run_dir / str(spec.experiment["prompts_file"])
    shipped = model_prompts(spec.model)
    return Path(shipped) if shipped else DEFAULT_PROMPTS


def encode_all(
    prompts: list[Prompt],
    tokenizer: Any,
    target: TargetModel,
    max_new_tokens: int,
    enable_thinking: bool,
    name: str,
    overhang: int = 0,
) -> list[torch.Tensor]:
    """Every prompt's token ids; a prompt that leaves no room for the new tokens (and the `overhang` a last
    round's draft block or tree may reach past them) is an error, before anything is decoded."""
    limit = context_length(target.model)
    encoded = []
    for prompt in prompts:
        ids = encode(prompt, tokenizer, target.embed.num_embeddings, enable_thinking)
        needed = ids.shape[0] + max_new_tokens + overhang
        if limit is not None and needed > limit:
            extra = f" and {overhang} for a round's draft or tree (decode.tree_budgets)" if overhang else ""
            raise ValueError(
                f"prompt {prompt.id!r} has {ids.shape[0]} tokens: with decode.max_new_tokens={max_new_tokens}{extra} "
                f"it needs {needed} positions, more than model {name}'s context of {limit}"
            )
        encoded.append(ids)
    return encoded


def load_pair(spec: Spec, log: EventLog) -> tuple[Any, TargetModel, Any]:
    """The target (the transformers model and its wrapper) and its drafter, the layout's params logged (a
    warning when no tested model shares it), `decode.block_size` applied to the drafter."""
    log.progress("setup", 0, 2, f"loading {spec.model.name} and its draft")
    started = time.perf_counter()
    model = load_model(spec.model, spec.seed)
    target = TargetModel(model)
    drafter = load_drafter(spec.model, spec.seed, model)
    LOG.info(
        "loaded %s (%s, %s) and its draft in %.1f s",
        spec.model.name, str(target.dtype).removeprefix("torch."), target.device, time.perf_counter() - started,
    )  # fmt: skip
    params, uncovered = layout_params(model, drafter.config.to_dict(), spec.model.source == "pretrained")
    log.emit("params", params)
    if uncovered:
        LOG.warning("%s", uncovered)
    if spec.decode.get("block_size"):
        drafter.block_size = int(spec.decode["block_size"])
    return model, target, drafter


def run_ddtree_gdn(spec: Spec, log: EventLog) -> dict[str, str]:
    model, target, drafter = load_pair(spec, log)
    tokenizer = load_tokenizer(spec.model)
    settings = Settings(
        max_new_tokens=int(spec.decode.get("max_new_tokens", 64)),
        temperature=float(spec.decode.get("temperature", 0.0)),
        repeats=int(spec.decode.get("repeats", 1)),
        stop_tokens=stop_token_ids(model, tokenizer),
        seed=spec.seed,
    )
    prompts = load_prompt_file(prompt_source(spec), spec.experiment.get("num_prompts"))
    enable_thinking = bool(spec.experiment.get("enable_thinking", False))
    budgets = [int(b) for b in spec.decode.get("tree_budgets", [16, 32, 64])]
    overhang = max(drafter.block_size, max(budgets) + 1)  # a last round's draft block, or its tree's nodes
    encoded = encode_all(
        prompts, tokenizer, target, settings.max_new_tokens, enable_thinking, spec.model.name, overhang
    )
    _check_budgets(target, drafter.block_size, budgets, max(len(ids) for ids in encoded) + settings.max_new_tokens)
    methods = methods_for(budgets)
    passes = f" × {settings.repeats} repeats" if settings.repeats > 1 else ""
    log.progress("setup", 2, 2, f"{len(prompts)} prompts × {len(methods)} methods{passes}")
    compiled = _compiled_rounds(spec, log, target, drafter, methods, encoded, settings)
    slices = NodeCostSlices.of(spec, target, drafter, len(prompts), settings, budgets)
    context = _job_context(spec, target, prompts)
    for method in methods:
        params = {**context, **_method_params(method, drafter.block_size, settings, len(prompts), compiled is not None)}
        log.emit("params", params, scope=method.scope)
    comparison = Comparison(methods, settings.temperature, target.dtype)
    profiles = {m.scope: AcceptanceProfile() for m in methods if m.drafts}
    curves = {m.scope: BudgetCurve(m.budget) for m in methods if m.name == "ddtree"}
    total = len(prompts) * len(methods) * settings.repeats
    with (spec.run_dir / GENERATIONS_FILE).open("w", encoding="utf-8") as generations:
        for index, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):

            def announce(method: Method, repeat: int, index: int = index, prompt: Prompt = prompt) -> None:
                stop_signal.check()
                done = (index * settings.repeats + repeat) * len(methods) + methods.index(method)
                tau, speed = comparison.tau_so_far(method.scope), comparison.tokens_per_s_so_far(method.scope)
                message = f"{method.scope} · prompt {index + 1}/{len(prompts)}"
                message += (f" · tau {tau:.2f}" if tau else "") + (f" · {speed:.0f} tok/s" if speed else "")
                log.progress("decode", done, total, message)

            rounds, prefiller = (compiled.rounds, compiled.prefiller) if compiled is not None else (None, None)
            run = run_prompt(target, drafter, ids, methods, settings, index, announce, rounds, prefiller)
            divergences = comparison.add(run)
            if slices is not None:
                slices.after(index, ids, log)
            for scope, profile in profiles.items():
                profile.add(run.first(scope).accepted_ranks)
            for scope, curve in curves.items():
                curve.add(run.first(scope).accepted_nodes)
            row = _generation_row(prompt, run, methods, divergences, tokenizer, comparison.exactness)
            generations.write(json.dumps(row, ensure_ascii=False) + "\n")
            generations.flush()
    log.progress("decode", total, total, "done")
    summary = comparison.metrics()
    node_costs = slices.costs() if slices is not None else None
    costs: dict[str, float] = {}
    if compiled is not None:
        for scope, seconds in compiled.compile_seconds.items():
            if scope in summary:  # the methods' rounds; "prefill" is the job's
                summary[scope]["compile_s"] = seconds
        recompiles = compiled.recompiles()
        costs = {
            "compile_s": sum(compiled.compile_seconds.values()),
            "prefill.compile_s": compiled.compile_seconds["prefill"],
            "recompiles": float(recompiles),
        }
        if recompiles:
            LOG.warning("decode.compile: %d graphs were compiled again after the warm-up (a shape changed)", recompiles)
    curve = budget_curve_record(methods, curves, summary)
    prediction = predict_budget(methods, curve, node_costs, summary, compiled is not None)
    # A run page lists metrics in the order they were first logged (see HEADLINE_FIRST): the answer first.
    headline, verdict = headline_metrics(summary)
    best = {key: value for key, value in headline.items() if key.startswith("best.")}
    log.emit("metrics", {**best, **_predicted_best(prediction), **headline}, step=0)  # the job's run answers
    if costs:
        log.emit("metrics", costs, step=0)
    for scope, metrics in summary.items():
        log.emit("metrics", _headline_first(metrics), scope=scope, step=0)
    _emit_budget_curves(log, curve, node_costs, prediction)
    for scope, tally in comparison.tallies.items():
        _emit_rounds(log, scope, tally.acceptance_lengths)
    if verdict is not None:
        log.emit("tags", _best_tags(verdict, methods))
    extras = {
        "budget_curve": curve,
        "node_costs": node_costs.as_record() if node_costs is not None else None,
        "prediction": prediction.as_record() if prediction is not None else None,
        "acceptance_profiles": {scope: profile.as_record() for scope, profile in profiles.items()},
    }
    _write_summary(spec, methods, summary, comparison, str(target.device), drafter.block_size, verdict, extras)
    log.emit("artifact", {"path": SUMMARY_FILE})
    log.emit("artifact", {"path": GENERATIONS_FILE})
    lines = _terminal_summary(summary, verdict)
    if prediction is not None:
        lines["budget"] = prediction.line()
    return lines


# Prompts after which the node costs are measured (evenly spaced), at most: enough samples to see the machine
# as the decodes do, without costing a long prompt set a measurement per prompt.
NODE_COST_POINTS = 8


@dataclass
class NodeCostSlices:
    """`decode.node_costs`: the round's stages against tree size (`decoding.node_cost`), up to the largest
    budget's tree, measured in slices after some of the prompts (`after`), each at that prompt's context
    halfway through its decode (the prompt and half the new tokens), `decode.node_cost_repeats` rounds per
    size and slice. Slices between the decodes see the machine as the decodes did, where a measurement all
    before them saw whatever speed the machine had then (`NodeCostSampler`)."""

    sampler: NodeCostSampler
    points: set[int]  # prompt indices after which a slice is measured
    repeats: int
    half: int  # half the new tokens: where an average round of a decode verifies

    @classmethod
    def of(
        cls, spec: Spec, target: TargetModel, drafter: Any, prompts: int, settings: Settings, budgets: list[int]
    ) -> NodeCostSlices | None:
        if not spec.decode.get("node_costs", True):
            return None
        largest = max(budgets)
        sizes = node_cost_sizes(largest, cap=largest + 1)  # 1, 2, 4, …, and the largest budget's tree itself
        points = {round(k * (prompts - 1) / max(NODE_COST_POINTS - 1, 1)) for k in range(NODE_COST_POINTS)}
        repeats = int(spec.decode.get("node_cost_repeats", 5))
        return cls(NodeCostSampler(target, drafter, sizes), points, repeats, settings.max_new_tokens // 2)

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
        sampler.measure(start, self.repeats, warmup=1, progress=progress)

    def costs(self) -> NodeCosts:
        costs = self.sampler.costs()
        if costs.unmeasured:
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
    curve: dict[str, Any] | None,
    costs: NodeCosts | None,
    summary: dict[str, dict[str, float]],
    compiled: bool,
) -> Prediction | None:
    """tokens/s predicted at every budget (`budget_choice`); None without both a curve and the node costs, or
    where they cannot predict (a warning says why: the decode's own figures are not to be lost to it)."""
    if curve is None or costs is None:
        return None
    measured = [
        Measured(m.budget, summary[m.scope]["tokens_per_s"], summary[m.scope]["speedup_vs_ar"])
        for m in methods
        if m.name == "ddtree"
    ]
    try:
        return predict(curve["tau"], costs, summary[methods[0].scope]["tokens_per_s"], measured, compiled)
    except ValueError as exc:
        LOG.warning("no predicted budget: %s", exc)
        return None


def _predicted_best(prediction: Prediction | None) -> dict[str, float]:
    """`best.predicted_budget` and `best.predicted_speedup_vs_ar`, which lead the job's page beside `best.*`."""
    if prediction is None:
        return {}
    return {
        "best.predicted_budget": float(prediction.best_budget),
        "best.predicted_speedup_vs_ar": prediction.best_speedup_vs_ar,
        "best.predicted_tokens_per_s": prediction.best_tokens_per_s,
    }


def _emit_budget_curves(
    log: EventLog, curve: dict[str, Any] | None, costs: NodeCosts | None, prediction: Prediction | None
) -> None:
    """The job's curves, each a metric history whose step is the budget (or the tree size): `tau_at_budget`,
    `tau_at_budget_error` (estimate − measured, at the budgets the run decoded), the node costs
    (`node_cost.verify_ms` …, step = nodes) and `predicted_tokens_per_s`."""
    if curve is not None:
        for budget, tau in enumerate(curve["tau"], start=1):
            log.emit("metrics", {"tau_at_budget": tau}, step=budget)
        for check in curve["checks"]:
            log.emit("metrics", {"tau_at_budget_error": check["error"]}, step=check["budget"])
    for step, metrics in metric_steps(costs) if costs is not None else ():
        log.emit("metrics", metrics, step=step)
    if prediction is not None:
        for budget, speed in zip(prediction.budgets, prediction.tokens_per_s, strict=True):
            log.emit("metrics", {"predicted_tokens_per_s": speed}, step=budget)


def _check_budgets(target: TargetModel, block_size: int, budgets: list[int], context: int) -> None:
    """A budget a draft block cannot fill (`tree_limits`), or whose tree the device cannot hold
    (`tree_memory`), is one line before any decode, not a misnamed run or an allocator's error mid-sweep."""
    free = free_bytes(target.device)
    for budget in sorted(budgets, reverse=True):
        problem = beyond_draft(budget, block_size, target.head.out_features)
        problem = problem or budget_problem(target, budget, context, free)
        if problem is not None:
            raise ValueError(problem)


def _compiled_rounds(
    spec: Spec,
    log: EventLog,
    target: TargetModel,
    drafter: Any,
    methods: list[Method],
    encoded: list[torch.Tensor],
    settings: Settings,
) -> CompiledRounds | None:
    """`decode.compile` (true, false, auto: on with CUDA): the prefill and every method's round in fixed shapes,
    compiled and warmed up now, before any clock; None when off, or when this host's torch could not (the run
    says why)."""
    setting = spec.decode.get("compile", "auto")
    if not wanted(setting, target.device):
        return None

    def progress(done: int, total: int, message: str) -> None:
        if threading.current_thread() is threading.main_thread():  # (the compile's ticker calls from its own)
            stop_signal.check()
        log.progress("compile", done, total, message)

    started = time.perf_counter()
    longest = max(len(ids) for ids in encoded)
    with CompileCache.open(spec.run_dir, bool(spec.decode.get("compile_cache", True))) as cache:
        outcome = compile_rounds(
            target, drafter, methods, encoded[0], longest, settings.max_new_tokens, progress, settings.temperature
        )
    if isinstance(outcome, str):
        LOG.warning("decode.compile: torch.compile failed on this host, decoding eagerly (%s)", outcome)
        return None
    cached = cache.outcome()
    log.emit("params", {"compile_cache": cached})
    LOG.info(
        "compiled the prefill and %d rounds in %.1f s (compile cache: %s)",
        len(methods), time.perf_counter() - started, cached,
    )  # fmt: skip
    return outcome


# The per-round series (step = round index): drafted tokens accepted in each round of the first pass. MLflow
# shows a series' last value beside the figures, where a bare `acceptance_length` read as the method's
# acceptance (that is `tau`); the name says it is one round's. No "/" in it: MLflow's charts put a "prefix/"
# section above the method's own figures.
ROUND_ACCEPTANCE = "round.accepted_tokens"

# What MLflow shows first. A run page lists a run's metrics in the order they were first logged (the store
# keeps that order), so these are logged first, the other figures next and the per-round series last. The
# compare view and the charts sort names alphabetically (`acceptance_length_mean` leads there); only renaming
# the public figures could change that.
HEADLINE_FIRST = ("tau", "speedup_vs_ar", "tokens_per_s", "lossless")

# What the job's own run shows per method (`ar.tokens_per_s`, `dflash.tau`, …), from each child's figures; the
# 95 % intervals over prompts (`ddtree_tb32.tau_ci_low`, …) only where the method has them (two prompts or more).
HEADLINE = ("tau", "tau_ci_low", "tau_ci_high", "tokens_per_s", "speedup_vs_ar", "speedup_vs_ar_ci_low",
            "speedup_vs_ar_ci_high", "speedup_vs_dflash", "speedup_vs_dflash_ci_low", "speedup_vs_dflash_ci_high",
            "tpot_ms", "prefill_ms", "ttft_ms", "acceptance_length_mean", "compile_s")  # fmt: skip
HEADLINE_AT_T0 = ("lossless", "near_tie_divergences", "unexplained_divergences")
ONE_PASS = "one pass per prompt (decode.repeats=1): no spread to tell noise from a difference"


@dataclass(frozen=True)
class Verdict:
    """What the job says about its drafting methods: the `best.*` tags and metrics, the description's Best
    line, the terminal's `best` row. `best` is the method named, or None where no method is clearly ahead;
    `basis` says how far the naming can be trusted, in the words the page shows."""

    fastest: str  # the drafting method with the highest median speedup_vs_ar
    best: str | None
    basis: str


def headline_metrics(summary: dict[str, dict[str, float]]) -> tuple[dict[str, float], Verdict | None]:
    """Each method's headline figures under `<method>.<metric>`, and `best.*` where a best is named (`judge`).
    In the order the job's run page lists them: `best.*`, each figure of HEADLINE_FIRST for every method (the
    comparison on one screen), then every method's other figures."""
    verdict = judge(summary)
    headline: dict[str, float] = {}
    if verdict is not None and verdict.best is not None:
        headline.update({f"best.{key}": summary[verdict.best][key] for key in ("speedup_vs_ar", "tau", "tokens_per_s")})
    for key in HEADLINE_FIRST:
        headline.update({f"{scope}.{key}": metrics[key] for scope, metrics in summary.items() if key in metrics})
    for scope, metrics in summary.items():
        rest = (key for key in (*HEADLINE, *HEADLINE_AT_T0) if key not in HEADLINE_FIRST and key in metrics)
        headline.update({f"{scope}.{key}": metrics[key] for key in rest})
    constant = {f"ar.{key}" for key in AR_BY_DEFINITION}
    return {k: v for k, v in headline.items() if k not in constant}, verdict


def judge(summary: dict[str, dict[str, float]]) -> Verdict | None:
    """Which drafting method the job names best, and how sure that is (None: no drafting method ran).

    One pass per prompt has no spread, so its fastest may be noise (three identical one-pass runs once named
    three different winners): it is named, and the basis says it is one pass. With repeats, a method is named
    only when its slowest pass beats every other drafting method's fastest; otherwise the spreads overlap, no
    method is clearly ahead and none is named. A fastest method slower than AR says that first."""
    drafting = {scope: metrics for scope, metrics in summary.items() if scope != "ar"}
    if not drafting:
        return None
    fastest = max(drafting, key=lambda scope: drafting[scope]["speedup_vs_ar"])
    figures = drafting.pop(fastest)
    slower = "slower than AR, as is every drafting method here; " if figures["speedup_vs_ar"] < 1 else ""
    repeats = int(figures.get("repeats", 1))
    if repeats <= 1:
        return Verdict(fastest, fastest, slower + ONE_PASS)
    if not drafting:
        return Verdict(fastest, fastest, f"{slower}the only drafting method ({repeats} passes)")
    rival = max(drafting, key=lambda scope: _pass_speedups(drafting[scope])[1])
    low, high = _pass_speedups(figures)[0], _pass_speedups(drafting[rival])[1]
    if low > high:
        basis = f"ahead in all {repeats} passes: its slowest ×{low:.2f} beats {rival}'s fastest ×{high:.2f}"
        return Verdict(fastest, fastest, slower + basis)
    basis = (
        f"no method is clearly ahead over {repeats} passes: {fastest} {_pass_range(figures)} overlaps {rival} "
        f"{_pass_range(drafting[rival])}"
    )
    return Verdict(fastest, None, basis + ("; every drafting method is slower than AR" if slower else ""))


def _pass_speedups(metrics: dict[str, float]) -> tuple[float, float]:
    """The slowest and fastest pass's speedup (the median where a run has no spread)."""
    median = metrics["speedup_vs_ar"]
    return metrics.get("speedup_vs_ar_min", median), metrics.get("speedup_vs_ar_max", median)


def _pass_range(metrics: dict[str, float]) -> str:
    low, high = _pass_speedups(metrics)
    return f"×{low:.2f}–{high:.2f}"


def _headline_first(metrics: dict[str, float]) -> dict[str, float]:
    """A method's figures with HEADLINE_FIRST's in front: the order its run page lists them in."""
    return {**{key: metrics[key] for key in HEADLINE_FIRST if key in metrics}, **metrics}


def best_record(verdict: Verdict | None) -> dict[str, str | None] | None:
    """The verdict in `decode_summary.json`, whence the description's Best line: `scope` is the method named
    best, null where none is clearly ahead (`basis` then says so)."""
    if verdict is None:
        return None
    return {"scope": verdict.best, "fastest": verdict.fastest, "basis": verdict.basis}


def _best_tags(verdict: Verdict, methods: list[Method]) -> dict[str, str]:
    """`best.basis` always; `best.method` and `best.tree_budget` only where a best is named."""
    tags = {"best.basis": verdict.basis}
    if verdict.best is not None:
        tags["best.method"] = verdict.best
        budget = _budget_of(methods, verdict.best)
        if budget:
            tags["best.tree_budget"] = str(budget)
    return tags


def _budget_of(methods: list[Method], scope: str) -> int | None:
    return next((m.budget for m in methods if m.scope == scope), None)


def _job_context(spec: Spec, target: TargetModel, prompts: list[Prompt]) -> dict[str, Any]:
    """What a child run needs to be compared with children of other jobs: the job's model, dtype, seed, prompts."""
    source = spec.experiment.get("prompts")
    return {
        "model": spec.model.name,
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device),
        "seed": spec.seed,
        "prompts": str(source) if source is not None else prompt_source(spec).name,
    }


def _method_params(method: Method, block_size: int, settings: Settings, prompts: int, compiled: bool) -> dict[str, Any]:
    return {
        "method": method.name,
        "tree_budget": method.budget,
        "block_size": block_size if method.drafts else 1,
        "temperature": settings.temperature,
        "max_new_tokens": settings.max_new_tokens,
        "repeats": settings.repeats,
        "num_prompts": prompts,
        "compiled": compiled,
    }


def _emit_rounds(log: EventLog, scope: str, lengths: list[int]) -> None:
    """The method's per-round series (first pass, every prompt's rounds in turn), once its figures are logged:
    a run page lists metrics in the order they first came, and the figures are what it should lead with."""
    for step, length in enumerate(lengths):
        log.emit("metrics", {ROUND_ACCEPTANCE: float(length)}, scope=scope, step=step)


def _generation_row(
    prompt: Prompt,
    run: PromptRun,
    methods: list[Method],
    divergences: dict[str, Divergence | None],
    tokenizer: Any,
    exact: bool,
) -> dict[str, Any]:
    """One prompt: its text as the model saw it, and every method's output, speed and agreement with AR."""
    outputs = {}
    for method in methods:
        results = run.results[method.scope]
        first = results[0]
        divergence = divergences[method.scope]
        outputs[method.scope] = {
            "text": decode_text(first.tokens, tokenizer),
            "tokens": first.tokens,
            "rounds": first.rounds,
            "tau": first.tau,
            "decode_s": statistics.median(r.decode_seconds for r in results),
            "decode_s_repeats": [r.decode_seconds for r in results],
            "matches_ar": (divergence is None) if exact else None,  # compared at temperature 0 only
            "divergence": divergence.as_record() if divergence is not None else None,
        }
    return {
        "id": prompt.id,
        "prompt": decode_text(run.tokens, tokenizer),
        "prompt_tokens": len(run.tokens),
        "prefill_ms": 1000 * run.prefill_target_seconds,
        "draft_prefill_ms": 1000 * run.prefill_draft_seconds,
        "methods": outputs,
    }


def _write_summary(
    spec: Spec,
    methods: list[Method],
    summary: dict[str, dict[str, float]],
    comparison: Comparison,
    device: str,
    block_size: int,
    verdict: Verdict | None,
    extras: dict[str, Any],
) -> None:
    """`decode_summary.json`: what the orchestrator's table and plots read. `extras`: the budget curve, the
    node costs, the prediction and the acceptance profiles (each null where the run has none)."""
    document = {
        "model": spec.model.name,
        "dtype": str(comparison.dtype).removeprefix("torch."),
        "device": device,
        "temperature": float(spec.decode.get("temperature", 0.0)),
        "block_size": block_size,
        "repeats": int(spec.decode.get("repeats", 1)),
        "methods": [{"scope": m.scope, "method": m.name, "tree_budget": m.budget, **summary[m.scope]} for m in methods],
        "acceptance_lengths": {scope: t.acceptance_lengths for scope, t in comparison.tallies.items()},
        "best": best_record(verdict),
        **extras,
    }
    (spec.run_dir / SUMMARY_FILE).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def _terminal_summary(summary: dict[str, dict[str, float]], verdict: Verdict | None = None) -> dict[str, str]:
    """One line per method, then `best`: the verdict the job's page shows, so the terminal names no winner
    the page would not. A figure's 95 % interval over prompts follows it where the method has one."""

    def _ci(metrics: dict[str, float], key: str) -> str:
        low, high = metrics.get(f"{key}_ci_low"), metrics.get(f"{key}_ci_high")
        return "" if low is None or high is None else f" ({low:.2f}–{high:.2f})"

    lines = {}
    for scope, m in summary.items():
        text = f"tau {m['tau']:.2f}{_ci(m, 'tau')} · {m['tokens_per_s']:.1f} tok/s"
        text += f" · ×{m['speedup_vs_ar']:.2f}{_ci(m, 'speedup_vs_ar')} vs AR"
        if "speedup_vs_dflash" in m:
            text += f" · ×{m['speedup_vs_dflash']:.2f}{_ci(m, 'speedup_vs_dflash')} vs DFlash"
        text += f" · repetition {m['repetition_share']:.2f}"
        if "lossless" in m:
            text += f" · lossless {m['lossless']:.2f}"
            if m["lossless"] < 1:
                text += f" ({m['near_tie_divergences']:.0f} near-tie, {m['unexplained_divergences']:.0f} unexplained)"
        lines[scope] = text
    if verdict is not None and verdict.best is not None:
        m = summary[verdict.best]
        lines["best"] = f"{verdict.best}, ×{m['speedup_vs_ar']:.2f} vs AR at tau {m['tau']:.2f} — {verdict.basis}"
    elif verdict is not None:
        lines["best"] = verdict.basis
    return lines
