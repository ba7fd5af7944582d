"""`experiment=ddtree_gdn`: AR, DFlash and DDTree at every tree budget over a prompt set, one child run each.

Target and draft are loaded once. For every prompt, AR runs first; its tokens are the reference for
`lossless` (at temperature 0) and its speed the reference for `speedup_vs_ar`. Each method and budget
reports per-round acceptance lengths as they happen and its summary metrics at the end, under its own
scope (`ar`, `dflash`, `ddtree_tb32`, …). `decode_summary.json` carries what the orchestrator plots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from remote_worker.decoding.loop import STAGES, DecodeResult, decode
from remote_worker.events import EventLog
from remote_worker.models.loading import load_drafter, load_model, load_tokenizer, model_prompts, stop_token_ids
from remote_worker.models.target import TargetModel
from remote_worker.prompts import decode_text, encode, load_prompts
from remote_worker.spec import Spec

SUMMARY_FILE = "decode_summary.json"
GENERATIONS_FILE = "generations.jsonl"


@dataclass(frozen=True)
class Method:
    scope: str
    name: str
    budget: int = 0


@dataclass
class Totals:
    """One method's results summed over the prompts."""

    tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: list[float] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    matches: int = 0
    prompts: int = 0
    repetitive_rounds: int = 0
    fresh_round_tokens: list[int] = field(default_factory=list)  # tokens per round of the other rounds

    def add(self, result: DecodeResult, matches_ar: bool, prompt: list[int]) -> None:
        flags = repetition_flags(prompt, result.tokens, result.acceptance_lengths)
        self.repetitive_rounds += sum(flags)
        self.fresh_round_tokens += [a + 1 for a, f in zip(result.acceptance_lengths, flags, strict=True) if not f]
        self.tokens += len(result.tokens)
        self.seconds += result.total_seconds
        self.first_token_seconds.append(result.first_token_seconds)
        self.acceptance_lengths += result.acceptance_lengths
        for stage, seconds in result.stage_seconds.items():
            self.stage_seconds[stage] += seconds
        self.matches += matches_ar
        self.prompts += 1

    def metrics(self, ar: Totals) -> dict[str, float]:
        rounds = max(len(self.acceptance_lengths), 1)
        tokens_per_s = self.tokens / self.seconds if self.seconds else 0.0
        ar_tokens_per_s = ar.tokens / ar.seconds if ar.seconds else 0.0
        ttft = sum(self.first_token_seconds) / max(len(self.first_token_seconds), 1)
        later_tokens = max(self.tokens - self.prompts, 1)
        return {
            "tau": sum(a + 1 for a in self.acceptance_lengths) / rounds,
            "tokens_per_s": tokens_per_s,
            "speedup_vs_ar": tokens_per_s / ar_tokens_per_s if ar_tokens_per_s else 0.0,
            "lossless": self.matches / max(self.prompts, 1),
            "ttft_ms": 1000 * ttft,
            "tpot_ms": 1000 * (self.seconds - sum(self.first_token_seconds)) / later_tokens,
            **{f"{stage}_ms_per_round": 1000 * seconds / rounds for stage, seconds in self.stage_seconds.items()},
            "rounds": float(len(self.acceptance_lengths)),
            "repetition_share": self.repetitive_rounds / rounds,
            "tau_without_repetition": sum(self.fresh_round_tokens) / max(len(self.fresh_round_tokens), 1),
            "generated_tokens": float(self.tokens),
        }


def methods_for(spec: Spec) -> list[Method]:
    budgets = [int(b) for b in spec.decode.get("tree_budgets", [16, 32, 64])]
    return [Method("ar", "ar"), Method("dflash", "dflash")] + [Method(f"ddtree_tb{b}", "ddtree", b) for b in budgets]


def run_ddtree_gdn(spec: Spec, log: EventLog) -> dict[str, str]:
    temperature = float(spec.decode.get("temperature", 0.0))
    max_new_tokens = int(spec.decode.get("max_new_tokens", 64))
    log.progress("setup", 0, 2, f"loading {spec.model.name} and its draft")
    model = load_model(spec.model, spec.seed)
    target = TargetModel(model)
    drafter = load_drafter(spec.model, spec.seed, model)
    if spec.decode.get("block_size"):
        drafter.block_size = int(spec.decode["block_size"])
    tokenizer = load_tokenizer(spec.model)
    stops = stop_token_ids(model, tokenizer)
    prompts = load_prompts(
        spec.experiment.get("prompts") or model_prompts(spec.model), spec.experiment.get("num_prompts")
    )
    methods = methods_for(spec)
    log.progress("setup", 2, 2, f"{len(prompts)} prompts × {len(methods)} methods")
    for method in methods:
        log.emit(
            "params",
            {
                "method": method.name,
                "tree_budget": method.budget,
                "block_size": drafter.block_size if method.name != "ar" else 1,
                "temperature": temperature,
                "max_new_tokens": max_new_tokens,
                "num_prompts": len(prompts),
            },
            scope=method.scope,
        )
    totals = {m.scope: Totals() for m in methods}
    generations = []
    rounds_so_far = dict.fromkeys(totals, 0)
    generator = torch.Generator().manual_seed(spec.seed)
    for index, prompt in enumerate(prompts):
        ids = encode(prompt, tokenizer, target.embed.num_embeddings)
        reference: list[int] | None = None
        for method in methods:
            log.progress(
                "decode",
                index * len(methods) + methods.index(method),
                len(prompts) * len(methods),
                f"{prompt.id}: {method.scope}",
            )
            result = decode(
                target,
                ids,
                method=method.name,
                max_new_tokens=max_new_tokens,
                drafter=None if method.name == "ar" else drafter,
                budget=method.budget,
                temperature=temperature,
                stop_tokens=stops,
                generator=generator,
            )
            if reference is None:
                reference = result.tokens
            matches = temperature == 0 and result.tokens == reference
            totals[method.scope].add(result, matches, ids.tolist())
            _emit_rounds(log, method.scope, result.acceptance_lengths, rounds_so_far)
            generations.append(
                {
                    "prompt": prompt.id,
                    "method": method.scope,
                    "tokens": result.tokens,
                    "text": decode_text(result.tokens, tokenizer),
                    "matches_ar": matches,
                }
            )
    log.progress("decode", len(prompts) * len(methods), len(prompts) * len(methods), "done")
    summary = {scope: t.metrics(totals["ar"]) for scope, t in totals.items()}
    if temperature > 0:  # sampled outputs differ from AR's by design: `lossless` is defined at temperature 0
        for metrics in summary.values():
            del metrics["lossless"]
    for scope, metrics in summary.items():
        log.emit("metrics", metrics, scope=scope, step=0)
    _write_artifacts(spec, log, methods, summary, totals, generations)
    return _terminal_summary(summary, temperature)


def repetition_flags(
    prompt: list[int], tokens: list[int], acceptance_lengths: list[int], max_period: int = 16
) -> list[bool]:
    """For each round: do its committed tokens only repeat what came `p` tokens earlier, for some p <= 16?

    A tiny model easily falls into a loop or a run of whitespace, which any drafter predicts perfectly; this
    marks such rounds, so that a high tau can be told apart from a degenerate continuation."""
    sequence, start, flags = prompt + tokens, len(prompt), []
    for accepted in acceptance_lengths:
        end = min(start + accepted + 1, len(sequence))
        flags.append(
            any(
                all(sequence[k] == sequence[k - p] for k in range(start, end))
                for p in range(1, min(max_period, start) + 1)
            )
        )
        start = end
    return flags


def _emit_rounds(log: EventLog, scope: str, lengths: list[int], rounds_so_far: dict[str, int]) -> None:
    for length in lengths:
        log.emit("metrics", {"acceptance_length": float(length)}, scope=scope, step=rounds_so_far[scope])
        rounds_so_far[scope] += 1


def _write_artifacts(
    spec: Spec,
    log: EventLog,
    methods: list[Method],
    summary: dict[str, dict[str, float]],
    totals: dict[str, Totals],
    generations: list[dict[str, Any]],
) -> None:
    document = {
        "model": spec.model.name,
        "methods": [{"scope": m.scope, "method": m.name, "tree_budget": m.budget, **summary[m.scope]} for m in methods],
        "acceptance_lengths": {scope: t.acceptance_lengths for scope, t in totals.items()},
    }
    (spec.run_dir / SUMMARY_FILE).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    with (spec.run_dir / GENERATIONS_FILE).open("w", encoding="utf-8") as f:
        for line in generations:
            f.write(json.dumps(line) + "\n")
    log.emit("artifact", {"path": SUMMARY_FILE})
    log.emit("artifact", {"path": GENERATIONS_FILE})


def _terminal_summary(summary: dict[str, dict[str, float]], temperature: float) -> dict[str, str]:
    lines = {}
    for scope, m in summary.items():
        text = f"tau {m['tau']:.2f} · {m['tokens_per_s']:.1f} tok/s · ×{m['speedup_vs_ar']:.2f} vs AR"
        text += f" · repetition {m['repetition_share']:.2f}"
        if temperature == 0:
            text += f" · lossless {m['lossless']:.2f}"
        lines[scope] = text
    return lines
