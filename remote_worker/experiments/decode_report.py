"""What the decode experiment reports once its prompts are decoded: the job's headline metrics in the order its
page lists them, the per-round series, a generation row per prompt, `decode_summary.json` (what the
orchestrator's tables and plots read) and the terminal's summary lines.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from remote_worker.decoding.comparison import Comparison, Method, PromptRun
from remote_worker.decoding.divergence import Divergence
from remote_worker.decoding.figure_rules import AR_BY_DEFINITION, MIN_PROMPTS, ONLINE, versus_best_fixed
from remote_worker.events import EventLog
from remote_worker.experiments.verdict import Verdict, best_record, judge
from remote_worker.prompt_set import Prompt
from remote_worker.prompts import decode_text
from remote_worker.safe_files import Folder
from remote_worker.spec import Spec
from remote_worker.wording import counted

SUMMARY_FILE = "decode_summary.json"
GENERATIONS_FILE = "generations.jsonl"

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
# 95 % intervals over prompts (`ddtree_tb32.tau_ci_low`, …) only where the method has them (MIN_PROMPTS or more).
HEADLINE = ("tau", "tau_ci_low", "tau_ci_high", "tokens_per_s", "speedup_vs_ar", "speedup_vs_ar_ci_low",
            "speedup_vs_ar_ci_high", "speedup_vs_dflash", "speedup_vs_dflash_ci_low", "speedup_vs_dflash_ci_high",
            "tpot_ms", "prefill_ms", "ttft_ms", "acceptance_length_mean", "compile_s", "peak_memory_mb")  # fmt: skip
HEADLINE_AT_T0 = ("lossless", "near_tie_divergences", "unexplained_divergences")
# AR measured against itself, or with no rounds to accept: 0 by definition, left off the job's page (they led
# its charts, which MLflow sorts by name, with `ar.acceptance_length_mean` at 0.00); in AR's own run still.
AR_AGAINST_ITSELF = ("acceptance_length_mean", "near_tie_divergences", "unexplained_divergences")


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
    constant = {f"ar.{key}" for key in (*AR_BY_DEFINITION, *AR_AGAINST_ITSELF)}
    return {k: v for k, v in headline.items() if k not in constant}, verdict


def headline_first(metrics: dict[str, float]) -> dict[str, float]:
    """A method's figures with HEADLINE_FIRST's in front: the order its run page lists them in."""
    return {**{key: metrics[key] for key in HEADLINE_FIRST if key in metrics}, **metrics}


def emit_rounds(log: EventLog, scope: str, lengths: list[int]) -> None:
    """The method's per-round series (first pass, every prompt's rounds in turn), once its figures are logged:
    a run page lists metrics in the order they first came, and the figures are what it should lead with."""
    for step, length in enumerate(lengths):
        log.emit("metrics", {ROUND_ACCEPTANCE: float(length)}, scope=scope, step=step)


def generation_row(
    prompt: Prompt,
    run: PromptRun,
    methods: list[Method],
    divergences: dict[str, Divergence | None],
    tokenizer: Any,
    exact: bool,
    reference: str = "ar",
) -> dict[str, Any]:
    """One prompt: its text as the model saw it, and every method's output, speed and agreement with the
    reference method (`matches_ar`; `matches_dflash` where the record was decoded without AR)."""
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
            f"matches_{reference}": (divergence is None) if exact else None,  # compared at temperature 0 only
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


def write_summary(
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
    Folder(spec.run_dir).write_whole(SUMMARY_FILE, (json.dumps(document, indent=1) + "\n").encode())


def terminal_summary(summary: dict[str, dict[str, float]], verdict: Verdict | None = None) -> dict[str, str]:
    """One line per method, then `best`: the verdict the job's page shows, so the terminal names no winner
    the page would not. A figure's 95 % interval over prompts follows it where the method has one; where it has
    none for want of prompts, the line says how many it rests on."""

    def _ci(metrics: dict[str, float], key: str) -> str:
        low, high = metrics.get(f"{key}_ci_low"), metrics.get(f"{key}_ci_high")
        return "" if low is None or high is None else f" ({low:.2f}–{high:.2f})"

    lines = {}
    for scope, m in summary.items():
        text = f"tau {m['tau']:.2f}{_ci(m, 'tau')} · {m['tokens_per_s']:.1f} tok/s"
        text += f" · ×{m['speedup_vs_ar']:.2f}{_ci(m, 'speedup_vs_ar')} vs AR"
        if "speedup_vs_dflash" in m:
            text += f" · ×{m['speedup_vs_dflash']:.2f}{_ci(m, 'speedup_vs_dflash')} vs DFlash"
        prompts = int(m.get("prompts", 0))
        if scope != "ar" and "speedup_vs_ar_ci_low" not in m and 0 < prompts < MIN_PROMPTS:
            text += f" · {counted(prompts, 'prompt')}, too few for a 95 % interval"
        text += f" · repetition {m['repetition_share']:.2f}"
        if "lossless" in m:
            text += f" · lossless {m['lossless']:.2f}"
            if m["lossless"] < 1:
                text += f" ({m['near_tie_divergences']:.0f} near-tie, {m['unexplained_divergences']:.0f} unexplained)"
        lines[scope] = text
    said = versus_best_fixed(summary.get(ONLINE) or {})
    if said:  # a budget per round, against the fixed budget that decoded fastest here
        lines["online"] = f"ddtree_online {said}"
    if verdict is not None and verdict.best is not None:
        m = summary[verdict.best]
        lines["best"] = f"{verdict.best}, ×{m['speedup_vs_ar']:.2f} vs AR at tau {m['tau']:.2f} — {verdict.basis}"
    elif verdict is not None:
        lines["best"] = verdict.basis
    return lines
