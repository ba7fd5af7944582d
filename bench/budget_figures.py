"""The budget this CPU should use on the trained tiny pair: tau at every budget from the largest budget's
decode against the real decodes at the smaller ones, and tokens/s predicted from the node costs against the
measured tokens/s, all from one comparison (the code a run uses: `comparison`, `budget_curve`, `node_cost`,
`budget_choice`).

The node costs are measured in slices between the prompts' decodes, each at that prompt's context halfway
through its decode, as `experiment=ddtree_gdn` does (`NodeCostSlices`). The section runs twice: on the quiet
machine, and with a second process busy half the time on one core throughout (`load=True`), where the check
must flag what it cannot predict rather than mislead.

    .venv/bin/python -m bench.budget_figures    # this section alone (about a minute), JSON then Markdown
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bench.decode_figures import _load, _spec
from orchestrator.config.prompts import resolve_prompts
from remote_worker.decoding.budget_curve import BudgetCurve
from remote_worker.decoding.comparison import Comparison, Settings, methods_for, run_prompt
from remote_worker.decoding.loop import prefill
from remote_worker.decoding.node_cost import NodeCostSampler, context_tokens, node_cost_sizes
from remote_worker.experiments.budget_answer import budget_curve_record, predict_budget
from remote_worker.models.loading import model_prompts
from remote_worker.prompt_set import load_prompt_file
from remote_worker.prompts import encode

BUDGETS = (4, 8, 16, 32, 64)
COST_REPEATS = 3  # timed rounds per tree size after each prompt
FIGURES = ("tau", "tokens_per_s", "speedup_vs_ar")


# The second process of the loaded run: busy half of every 10 ms on one core. (A process spinning all the
# time made torch's two threads, one sharing its core, wait at every barrier: each decode 30–40× slower, a
# bench of hours; half the time slows it 2–3×, a busy host's way.)
SPIN = """
import time
while True:
    started = time.perf_counter()
    while time.perf_counter() - started < 0.005:
        pass
    time.sleep(0.005)
"""


@contextmanager
def _loaded(load: bool) -> Iterator[None]:
    """With `load`, a second Python process busy half the time (`SPIN`) for the duration of the block."""
    if not load:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def budget_figures(
    name: str = "tiny_trained",
    repeats: int = 3,
    max_new_tokens: int = 64,
    prompts: str | None = "humaneval_completion",
    num_prompts: int = 8,
    load: bool = False,
) -> dict[str, Any]:
    with _loaded(load):
        figures = _figures(name, repeats, max_new_tokens, prompts, num_prompts)
    return {**figures, "loaded": load}


def _figures(name: str, repeats: int, max_new_tokens: int, prompts: str | None, num_prompts: int) -> dict[str, Any]:
    target, drafter, tokenizer = _load(name, "cpu", "float32")
    chosen = resolve_prompts(prompts) if prompts else load_prompt_file(model_prompts(_spec(name, "cpu", "float32")))
    ids = [encode(p, tokenizer, target.embed.num_embeddings) for p in chosen[:num_prompts]]
    methods = methods_for(BUDGETS)
    settings = Settings(max_new_tokens, repeats=repeats)
    run_prompt(target, drafter, ids[0][:32], methods, Settings(8), index=0)  # warm-up
    largest = max(BUDGETS)
    sampler = NodeCostSampler(target, drafter, node_cost_sizes(largest, largest + 1))
    comparison = Comparison(methods, settings.temperature, target.dtype)
    curves = {m.scope: BudgetCurve(m.budget) for m in methods if m.name == "ddtree"}
    for index, prompt in enumerate(ids):
        run = run_prompt(target, drafter, prompt, methods, settings, index)
        comparison.add(run)
        for scope, curve in curves.items():
            curve.add(run.first(scope).accepted_nodes)
        start = prefill(target, context_tokens(prompt, len(prompt) - 1 + max_new_tokens // 2), drafter)
        sampler.measure(start, COST_REPEATS, warmup=1)
    costs = sampler.costs()
    metrics = comparison.metrics()
    trees = [m for m in methods if m.name == "ddtree"]
    curve = curves[f"ddtree_tb{largest}"]
    record = budget_curve_record(methods, curves, metrics)  # as experiment=ddtree_gdn
    prediction = predict_budget(methods, curves, costs, metrics, compiled=False)
    if record is None or prediction is None:
        raise RuntimeError("the budget section needs DDTree decodes and a prediction (see the warning above)")
    return {
        "model": name,
        "prompts": f"{prompts or 'held-out'} (first {len(ids)})",
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "context": costs.context,
        "cost_repeats": COST_REPEATS,
        "rounds": curve.rounds,
        "tau_at_budget": curve.tau(),
        "checks": record["checks"],
        "prediction": prediction.as_record(),
        "measured": {m.budget: {k: metrics[m.scope][k] for k in FIGURES} for m in trees},
        "ar_tokens_per_s": metrics["ar"]["tokens_per_s"],
        "dflash": {k: metrics["dflash"][k] for k in FIGURES},
        "node_costs": costs.as_record(),
    }


def budget_table(figures: dict[str, Any]) -> list[str]:
    """The curve at the budgets a reader scans, the estimate against the real decodes, and the prediction
    checked at AR and every decoded budget (each decoded budget predicted without its own rounds)."""
    tau, prediction = figures["tau_at_budget"], figures["prediction"]
    measured = {int(b): m for b, m in figures["measured"].items()}
    predicted = dict(zip(prediction["budgets"], prediction["tokens_per_s"], strict=True))
    checks = {c["budget"]: c for c in prediction["checks"]}
    shown = sorted({1, 2, *(b for b in (4, 8, 16, 32, 64) if b <= len(tau)), prediction["best_budget"]})
    note = (
        f"{figures['model']}, temperature 0, prompts: {figures['prompts']}, {figures['max_new_tokens']} new tokens, "
        f"decode speeds the median of {figures['repeats']} passes. tau estimated at every budget from the "
        f"{figures['rounds']} rounds of the budget-{len(tau)} decode (at {len(tau)} itself: those rounds); node "
        f"costs measured in whole rounds between the decodes, {figures['cost_repeats']} per tree size after each "
        f"prompt, at {figures['context']} tokens of context on average; predicted tokens/s = tau(b) / (draft "
        "+ tree(b+1) + verify(b+1) + commit + other), the means of the timed rounds, tau(b) from the smallest "
        "decoded budget at or above b. The check predicts each decoded budget from the next larger one's rounds "
        "(the largest from its own)."
    )
    lines = [note, "", "| budget | tau, estimated | tau, measured | tok/s, predicted | checked prediction "
             "| tok/s, measured | error |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    ar = checks[0]
    lines.append(f"| AR | | | | {ar['predicted_tokens_per_s']:.0f} | {ar['measured_tokens_per_s']:.0f} "
                 f"| {100 * ar['error']:+.1f} % |")  # fmt: skip
    for budget in shown:
        cells = [f"{tau[budget - 1]:.2f}", "", f"{predicted[budget]:.0f}" if budget in predicted else "", "", "", ""]
        if budget in measured:
            cells[1] = f"{measured[budget]['tau']:.2f}"
        if budget in checks:
            check = checks[budget]
            cells[3:] = [f"{check['predicted_tokens_per_s']:.0f}", f"{check['measured_tokens_per_s']:.0f}",
                         f"{100 * check['error']:+.1f} %"]  # fmt: skip
        lines.append(f"| {budget} | " + " | ".join(cells) + " |")
    return [*lines, "", f"Line: {prediction['line']}."]


def check_summary(quiet: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """The check's error on the quiet machine and with a second process spinning, side by side."""
    lines = ["| machine | median error | worst error | the run's line |", "|---|---|---|---|"]
    for what, figures in (("quiet", quiet), ("a second process busy half the time", loaded)):
        prediction = figures["prediction"]
        lines.append(f"| {what} | {100 * prediction['error_median']:.1f} % | {100 * prediction['error_worst']:.1f} % "
                     f"| {prediction['line']} |")  # fmt: skip
    return lines


def main() -> None:
    torch.set_grad_enabled(False)
    quiet, loaded = budget_figures(), budget_figures(load=True)
    print(json.dumps({"quiet": quiet, "loaded": loaded}, indent=1))
    print("\n".join([*budget_table(quiet), "", *budget_table(loaded), "", *check_summary(quiet, loaded)]))


if __name__ == "__main__":
    main()
