"""`experiment=ddtree_gdn`: AR, DFlash and DDTree at every tree budget over a prompt set, one child run each.

Target and draft are loaded once and every prompt is encoded (and checked against the model's context)
before anything is decoded. Each prompt is then prefilled once and decoded by every method from that
state, `decode.repeats` times, the methods taking turns (see `remote_worker.decoding.comparison`). Each
method reports per-round acceptance lengths as they happen and its summary metrics at the end, under its
own scope (`ar`, `dflash`, `ddtree_tb32`, …). `generations.jsonl` holds a row per prompt with every
method's output; `decode_summary.json` carries what the orchestrator plots.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from remote_worker import stop_signal
from remote_worker.decoding.comparison import Comparison, Method, PromptRun, Settings, methods_for, run_prompt
from remote_worker.decoding.compiled import CompiledRounds, compile_rounds, wanted
from remote_worker.decoding.divergence import Divergence
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
            raise ValueError(
                f"prompt {prompt.id!r} has {ids.shape[0]} tokens: with decode.max_new_tokens={max_new_tokens} and "
                f"{overhang} for a round's draft or tree (decode.tree_budgets) it needs {needed} positions, more "
                f"than model {name}'s context of {limit}"
            )
        encoded.append(ids)
    return encoded


def run_ddtree_gdn(spec: Spec, log: EventLog) -> dict[str, str]:
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
    _check_budgets(target, budgets, max(len(ids) for ids in encoded) + settings.max_new_tokens)
    methods = methods_for(budgets)
    passes = f" × {settings.repeats} repeats" if settings.repeats > 1 else ""
    log.progress("setup", 2, 2, f"{len(prompts)} prompts × {len(methods)} methods{passes}")
    compiled = _compiled_rounds(spec, log, target, drafter, methods, encoded, settings)
    context = _job_context(spec, target, prompts)
    for method in methods:
        params = {**context, **_method_params(method, drafter.block_size, settings, len(prompts), compiled is not None)}
        log.emit("params", params, scope=method.scope)
    comparison = Comparison(methods, settings.temperature, target.dtype)
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
            row = _generation_row(prompt, run, methods, divergences, tokenizer, comparison.exactness)
            generations.write(json.dumps(row, ensure_ascii=False) + "\n")
            generations.flush()
    log.progress("decode", total, total, "done")
    summary = comparison.metrics()
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
        log.emit("metrics", costs, step=0)
        if recompiles:
            LOG.warning("decode.compile: %d graphs were compiled again after the warm-up (a shape changed)", recompiles)
    for scope, metrics in summary.items():
        log.emit("metrics", metrics, scope=scope, step=0)
    headline, best = headline_metrics(summary)
    log.emit("metrics", headline, step=0)  # the job's own run answers the comparison on its page
    if best is not None:
        budget = _budget_of(methods, best)
        basis = best_basis(summary, best)
        log.emit(
            "tags", {"best.method": best, "best.basis": basis, **({"best.tree_budget": str(budget)} if budget else {})}
        )
    _write_summary(spec, methods, summary, comparison, str(target.device), drafter.block_size, best)
    log.emit("artifact", {"path": SUMMARY_FILE})
    log.emit("artifact", {"path": GENERATIONS_FILE})
    return _terminal_summary(summary)


def _check_budgets(target: TargetModel, budgets: list[int], context: int) -> None:
    """A budget whose tree the device cannot hold is one line before any decode (`tree_memory`), not an
    allocator's error in the middle of the sweep."""
    free = free_bytes(target.device)
    for budget in sorted(budgets, reverse=True):
        problem = budget_problem(target, budget, context, free)
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
    if not wanted(setting, target.device, settings.temperature):
        return None
    if settings.temperature != 0:
        LOG.warning("decode.compile: compiled rounds decode at temperature 0 only; decoding eagerly")
        return None

    def progress(done: int, total: int, what: str) -> None:
        stop_signal.check()
        log.progress("compile", done, total, f"{what} (decode.compile={setting})")

    started = time.perf_counter()
    longest = max(len(ids) for ids in encoded)
    outcome = compile_rounds(target, drafter, methods, encoded[0], longest, settings.max_new_tokens, progress)
    if isinstance(outcome, str):
        LOG.warning("decode.compile: torch.compile failed on this host, decoding eagerly (%s)", outcome)
        return None
    LOG.info("compiled the prefill and %d rounds in %.1f s", len(methods), time.perf_counter() - started)
    return outcome


# The per-round series (step = round): "/" puts it in a chart section of its own in MLflow, after the
# method's figures, and the name says it is one value per round, not the method's acceptance (that is `tau`).
ROUND_ACCEPTANCE = "round/acceptance_length"

# What the job's own run shows per method (`ar.tokens_per_s`, `dflash.tau`, …), from each child's figures.
HEADLINE = ("tau", "tokens_per_s", "speedup_vs_ar", "tpot_ms", "prefill_ms", "ttft_ms", "acceptance_length_mean",
            "compile_s")  # fmt: skip
HEADLINE_AT_T0 = ("lossless", "near_tie_divergences", "unexplained_divergences")


def headline_metrics(summary: dict[str, dict[str, float]]) -> tuple[dict[str, float], str | None]:
    """Each method's headline figures under `<method>.<metric>`, and `best.*`: the drafting method with the
    highest median `speedup_vs_ar` (its name is returned, for a tag; `best_basis` says how sure that is)."""
    headline = {
        f"{scope}.{key}": metrics[key]
        for scope, metrics in summary.items()
        for key in (*HEADLINE, *HEADLINE_AT_T0)
        if key in metrics
    }
    drafting = {scope: metrics for scope, metrics in summary.items() if scope != "ar"}
    if not drafting:
        return headline, None
    best = max(drafting, key=lambda scope: drafting[scope]["speedup_vs_ar"])
    headline.update({f"best.{key}": drafting[best][key] for key in ("speedup_vs_ar", "tau", "tokens_per_s")})
    return headline, best


def best_basis(summary: dict[str, dict[str, float]], best: str) -> str:
    """How far `best` (the highest median speedup) can be trusted, in words the page and the tag show.

    One pass per prompt has no spread, so its winner may be noise (three identical runs once named three
    winners): it says so. With repeats, the winner is clear only when its slowest pass beats every other
    method's fastest; otherwise the spreads overlap and no method is clearly ahead. A "best" slower than AR
    says that first."""
    metrics = summary[best]
    repeats = int(metrics.get("repeats", 1))
    slower = "slower than AR; " if metrics["speedup_vs_ar"] < 1 else ""
    if repeats <= 1:
        return f"{slower}one pass per prompt: no spread to tell noise from a difference"
    others = [m for scope, m in summary.items() if scope not in ("ar", best)]
    rival = max((m.get("speedup_vs_ar_max", m["speedup_vs_ar"]) for m in others), default=None)
    if rival is None or metrics.get("speedup_vs_ar_min", metrics["speedup_vs_ar"]) > rival:
        return f"{slower}ahead of every other method in all {repeats} passes"
    return f"{slower}not clearly ahead: its range over {repeats} passes overlaps another method's"


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


def _emit_rounds(log: EventLog, scope: str, lengths: list[int], rounds_so_far: dict[str, int]) -> None:
    for length in lengths:
        log.emit("metrics", {ROUND_ACCEPTANCE: float(length)}, scope=scope, step=rounds_so_far[scope])
        rounds_so_far[scope] += 1


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
    best: str | None,
) -> None:
    document = {
        "model": spec.model.name,
        "dtype": str(comparison.dtype).removeprefix("torch."),
        "device": device,
        "temperature": float(spec.decode.get("temperature", 0.0)),
        "block_size": block_size,
        "repeats": int(spec.decode.get("repeats", 1)),
        "methods": [{"scope": m.scope, "method": m.name, "tree_budget": m.budget, **summary[m.scope]} for m in methods],
        "acceptance_lengths": {scope: t.acceptance_lengths for scope, t in comparison.tallies.items()},
        "best": {"scope": best, "basis": best_basis(summary, best)} if best is not None else None,
    }
    (spec.run_dir / SUMMARY_FILE).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def _terminal_summary(summary: dict[str, dict[str, float]]) -> dict[str, str]:
    lines = {}
    for scope, m in summary.items():
        text = f"tau {m['tau']:.2f} · {m['tokens_per_s']:.1f} tok/s · ×{m['speedup_vs_ar']:.2f} vs AR"
        text += f" · repetition {m['repetition_share']:.2f}"
        if "lossless" in m:
            text += f" · lossless {m['lossless']:.2f}"
            if m["lossless"] < 1:
                text += f" ({m['near_tie_divergences']:.0f} near-tie, {m['unexplained_divergences']:.0f} unexplained)"
        lines[scope] = text
    return lines
