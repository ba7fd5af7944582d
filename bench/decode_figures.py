"""Decode figures on the trained tiny pairs: tau, tokens/s and speedup against AR of DFlash and DDTree.

Every prompt of the pair's held-out set is decoded by every method in turn (AR first), at temperature 0,
and the whole pass is repeated; tokens/s and speedup are medians over the passes, speedups taken within a
pass so AR and the method meet the same machine state. `lossless` checks every method's tokens against
AR's; `repetition_share` is the share of rounds that only repeat a short loop (see ddtree_gdn), and
`tau_without_repetition` the tau of the other rounds: what the draft achieves on text that is not a loop.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from orchestrator import CONF_DIR
from remote_worker.decoding.loop import decode
from remote_worker.experiments.ddtree_gdn import repetition_flags
from remote_worker.models.loading import load_drafter, load_model, load_tokenizer, model_prompts
from remote_worker.models.target import TargetModel
from remote_worker.prompts import encode, load_prompts
from remote_worker.spec import parse_spec

BUDGETS = (8, 16, 32, 64)


def _spec(name: str, device: str):
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    model.update(device=device)
    raw = {"run_id": "bench", "run_dir": "/", "seed": 0, "experiment": {"name": "ddtree_gdn"}, "model": model}
    return parse_spec(raw, Path("/")).model


def decode_figures(
    name: str, repeats: int, max_new_tokens: int = 96, device: str = "cpu", budgets: tuple[int, ...] = BUDGETS
) -> dict[str, Any]:
    spec = _spec(name, device)
    model = load_model(spec, seed=0)
    target, drafter = TargetModel(model), load_drafter(spec, seed=0, target=model)
    tokenizer = load_tokenizer(spec)
    prompts = [encode(p, tokenizer, target.embed.num_embeddings) for p in load_prompts(model_prompts(spec), None)]
    methods = [("ar", "ar", 0), ("dflash", "dflash", 0), *((f"ddtree_tb{b}", "ddtree", b) for b in budgets)]
    rates: dict[str, list[float]] = {scope: [] for scope, _, _ in methods}
    speedups: dict[str, list[float]] = {scope: [] for scope, _, _ in methods}
    lengths: dict[str, list[int]] = {scope: [] for scope, _, _ in methods}
    repetitive: dict[str, list[bool]] = {scope: [] for scope in rates}
    lossless = dict.fromkeys(rates, True)
    decode(target, prompts[0], method="ddtree", max_new_tokens=8, drafter=drafter, budget=8)  # warm-up
    for _ in range(repeats):
        seconds = dict.fromkeys(rates, 0.0)
        tokens = dict.fromkeys(rates, 0)
        for prompt in prompts:
            reference = None
            for scope, method, budget in methods:
                result = decode(
                    target,
                    prompt,
                    method=method,
                    max_new_tokens=max_new_tokens,
                    drafter=None if method == "ar" else drafter,
                    budget=budget,
                )
                reference = result.tokens if reference is None else reference
                lossless[scope] &= result.tokens == reference
                seconds[scope] += result.total_seconds
                tokens[scope] += len(result.tokens)
                if len(rates[scope]) == 0:  # acceptance and repetition from the first pass (identical each pass)
                    lengths[scope] += result.acceptance_lengths
                    repetitive[scope] += repetition_flags(prompt.tolist(), result.tokens, result.acceptance_lengths)
        for scope in rates:
            rates[scope].append(tokens[scope] / seconds[scope])
            speedups[scope].append((tokens[scope] / seconds[scope]) / (tokens["ar"] / seconds["ar"]))
    rows = []
    for scope, _method, budget in methods:
        rounds = max(len(lengths[scope]), 1)
        fresh = [a + 1 for a, repeats in zip(lengths[scope], repetitive[scope], strict=True) if not repeats]
        rows.append(
            {
                "method": scope,
                "tree_budget": budget or None,
                "tau": sum(a + 1 for a in lengths[scope]) / rounds,
                "tokens_per_s": statistics.median(rates[scope]),
                "speedup_vs_ar": statistics.median(speedups[scope]),
                "lossless": float(lossless[scope]),
                "repetition_share": sum(repetitive[scope]) / rounds,
                "tau_without_repetition": sum(fresh) / max(len(fresh), 1),
            }
        )
    return {
        "model": name,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "methods": rows,
    }
