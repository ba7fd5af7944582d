"""The paper protocol's decodes against the paper's full budget grid, on the trained tiny pair, side by side.

`sweep=paper` decodes AR, DFlash and DDTree at 64 and 1024 (tau at every other budget comes from the 1024
decode's trees); the paper's benchmark decodes DDTree at all seven budgets 16 … 1024. Here every prompt is
decoded once by all nine methods (the methods taking turns, `repeats` passes), so both sides' times come
from the same decodes: the protocol's time is the sum over its four methods, the grid's over all nine.
The check beside it: tau at each budget the protocol skips, from the 1024 decode's trees (`BudgetCurve`),
against the tau a real decode at that budget measured.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.decode_figures import _load
from orchestrator.config.prompts import resolve_prompts
from remote_worker.decoding.budget_curve import BudgetCurve
from remote_worker.decoding.comparison import Comparison, Settings, methods_for, run_prompt
from remote_worker.prompts import encode

PAPER_GRID = (16, 32, 64, 128, 256, 512, 1024)
PROTOCOL = (64, 1024)


def paper_protocol_figures(prompts: int = 4, max_new_tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
    target, drafter, tokenizer = _load("tiny_trained", "cpu", "float32")
    drafter.block_size = 16  # the paper's block size
    problems = resolve_prompts("humaneval_completion")[:prompts]
    ids = [encode(p, tokenizer, target.embed.num_embeddings) for p in problems]
    methods = methods_for(PAPER_GRID)
    settings = Settings(max_new_tokens, repeats=repeats)
    run_prompt(target, drafter, ids[0][:32], methods, Settings(8), index=0)  # warm-up
    comparison = Comparison(methods, 0.0, target.dtype)
    curve = BudgetCurve(max(PAPER_GRID))
    seconds: dict[str, list[float]] = {m.scope: [0.0] * repeats for m in methods}
    for index, prompt in enumerate(ids):
        run = run_prompt(target, drafter, prompt, methods, settings, index)
        comparison.add(run)
        curve.add(run.first(f"ddtree_tb{max(PAPER_GRID)}").accepted_nodes)
        for scope, results in run.results.items():
            for repeat, result in enumerate(results):
                seconds[scope][repeat] += result.decode_seconds
    protocol = {"ar", "dflash", *(f"ddtree_tb{b}" for b in PROTOCOL)}
    grid_s = [sum(seconds[m.scope][r] for m in methods) for r in range(repeats)]
    protocol_s = [sum(seconds[s][r] for s in protocol) for r in range(repeats)]
    ratios = [p / g for p, g in zip(protocol_s, grid_s, strict=True)]
    metrics = comparison.metrics()
    checks = [
        {"budget": b, "measured_tau": metrics[f"ddtree_tb{b}"]["tau"], "curve_tau": curve.at(b)}
        for b in PAPER_GRID
        if b not in PROTOCOL
    ]
    return {
        "model": "tiny_trained",
        "prompts": f"humaneval_completion (first {prompts})",
        "max_new_tokens": max_new_tokens,
        "block_size": 16,
        "repeats": repeats,
        "decodes_per_record": {"protocol": len(protocol), "paper_grid": len(methods)},
        "decode_s": {
            "protocol_median": statistics.median(protocol_s),
            "paper_grid_median": statistics.median(grid_s),
            "protocol_range": [min(protocol_s), max(protocol_s)],
            "paper_grid_range": [min(grid_s), max(grid_s)],
        },
        "time_ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "share_of_ar": statistics.median(seconds["ar"][r] / grid_s[r] for r in range(repeats)),
        "tau_checks": checks,
    }


def paper_protocol_table(figures: dict[str, Any]) -> list[str]:
    ratio, decode = figures["time_ratio"], figures["decode_s"]
    lines = [
        f"{figures['model']}, {figures['prompts']}, {figures['max_new_tokens']} new tokens, block size "
        f"{figures['block_size']}, temperature 0; every prompt decoded by all nine methods, "
        f"{figures['repeats']} passes, the methods taking turns; a side's time is the sum of its methods' decode "
        "times in one pass (medians, range).",
        "",
        "| side | decodes per record | decode s (range) |",
        "|---|---|---|",
        f"| protocol (AR, DFlash, DDTree 64 and 1024) | {figures['decodes_per_record']['protocol']} | "
        f"{_spread(decode, 'protocol')} |",
        f"| paper's grid (AR, DFlash, DDTree 16 … 1024) | {figures['decodes_per_record']['paper_grid']} | "
        f"{_spread(decode, 'paper_grid')} |",
        "",
        f"Protocol ÷ grid: ×{ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f}); AR alone is "
        f"{100 * figures['share_of_ar']:.0f} % of the grid's time.",
        "",
        "| budget the protocol skips | tau measured by its own decode | tau from the 1024 decode's trees |",
        "|---|---|---|",
        *(f"| {c['budget']} | {c['measured_tau']:.2f} | {c['curve_tau']:.2f} |" for c in figures["tau_checks"]),
    ]
    return lines


def _spread(decode: dict[str, Any], side: str) -> str:
    low, high = decode[f"{side}_range"]
    return f"{decode[f'{side}_median']:.2f} ({low:.2f}–{high:.2f})"
