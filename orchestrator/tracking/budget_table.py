"""The budget section of a job's page: tau at every budget from one decode (`budget_curve` in
`decode_summary.json`), the tokens/s the host's node costs predict (`prediction`), and the real decodes beside
them, as a Markdown table for the description and a CSV with every budget.

The table keeps the columns a reader scans (powers of two, the budgets the run decoded, the predicted best);
the CSV holds every budget from 1 to the largest.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from orchestrator.tracking.markdown_table import markdown_table

CSV_HEADER = ("budget", "tau_estimate", "tau_measured", "tau_error", "predicted_tokens_per_s", "tokens_per_s",
              "prediction_error", "tree_memory_mb", "peak_memory_mb")  # fmt: skip


def _rows(document: dict[str, Any]) -> list[dict[str, float | int | None]]:
    curve = document["budget_curve"]
    prediction = document.get("prediction") or {}
    measured = {m["tree_budget"]: m for m in document.get("methods") or [] if m.get("method") == "ddtree"}
    budgets = prediction.get("budgets") or []
    predicted = dict(zip(budgets, prediction.get("tokens_per_s") or [], strict=True))
    memory = dict(zip(budgets, prediction.get("tree_memory_mb") or [], strict=False))
    errors = {c["budget"]: c["error"] for c in prediction.get("checks") or []}
    rows = []
    for budget, tau in enumerate(curve["tau"], start=1):
        real = measured.get(budget) or {}
        rows.append({
            "budget": budget,
            "tau_estimate": tau,
            "tau_measured": real.get("tau"),
            "tau_error": tau - real["tau"] if "tau" in real else None,
            "predicted_tokens_per_s": predicted.get(budget),
            "tokens_per_s": real.get("tokens_per_s"),
            "prediction_error": errors.get(budget),
            "tree_memory_mb": memory.get(budget),
            "peak_memory_mb": real.get("peak_memory_mb"),
        })  # fmt: skip
    return rows


def budget_markdown(document: dict[str, Any]) -> list[str]:
    """The section's lines (empty without a curve): a heading that says where the estimate comes from, one
    column per budget shown, a row per figure. A curve the worker withheld (`curve_withheld`: a decode shorter
    than a draft block) is one line saying why."""
    curve = document.get("budget_curve")
    if not curve and document.get("curve_withheld"):
        return [f"**tau at every budget**: not estimated: {document['curve_withheld']}, so no round could hold a "
                "whole tree (decode more tokens for it)"]  # fmt: skip
    if not curve:
        return []
    rows = _rows(document)
    prediction = document.get("prediction") or {}
    shown = {2**k for k in range(len(rows).bit_length()) if 2**k <= len(rows)} | {len(rows)}
    shown |= {r["budget"] for r in rows if r["tau_measured"] is not None}
    if prediction.get("best_budget"):
        shown.add(prediction["best_budget"])
    if prediction.get("no_single") and prediction.get("within"):
        shown |= {prediction["within"][0], prediction["within"][-1]}
    picked = [r for r in rows if r["budget"] in shown]
    lines = [
        f"**tau at every budget**, estimated from the {curve['rounds']} rounds of {curve['scope']} (each round "
        "cut to the budget's first nodes); measured where the run decoded at that budget",
        "",
    ]
    figures = [("tau, estimated", "tau_estimate", "{:.2f}"), ("tau, measured", "tau_measured", "{:.2f}"),
               ("estimate − measured", "tau_error", "{:+.2f}")]  # fmt: skip
    if prediction:
        figures += [("tok/s, predicted", "predicted_tokens_per_s", "{:.0f}"),
                    ("tok/s, measured", "tokens_per_s", "{:.0f}"),
                    ("prediction error (held out)", "prediction_error", "{:+.0%}")]  # fmt: skip
        lines[0] += "; " + _prediction_note(prediction)
    if any(r["tree_memory_mb"] is not None for r in picked):
        figures.append(("tree memory, counted MB", "tree_memory_mb", "{:.3g}"))
    if any(r["peak_memory_mb"] is not None for r in picked):
        figures.append(("peak memory, measured MB", "peak_memory_mb", "{:.0f}"))
    body = [[name, *(form.format(r[key]) if r[key] is not None else "" for r in picked)] for name, key, form in figures]
    return lines + markdown_table(["budget", *(str(r["budget"]) for r in picked)], body)


def _prediction_note(prediction: dict[str, Any]) -> str:
    """Where the predicted speeds come from and how they were checked, in one sentence."""
    ar = next((c for c in prediction.get("checks") or [] if c["budget"] == 0), None)
    kind = prediction.get("costs_kind", "eager")
    text = (f"tok/s predicted from the {kind} rounds' costs measured between the prompts, with tau from the "
            "rounds of the smallest decoded budget at or above each")  # fmt: skip
    if ar is not None:
        text += (f"; AR {ar['measured_tokens_per_s']:.0f} tok/s measured, {ar['predicted_tokens_per_s']:.0f} predicted "
                 f"({ar['error']:+.0%})")  # fmt: skip
    return text + "; each decoded budget's prediction made without its own rounds (the largest's: with them)"


def budget_line(document: dict[str, Any]) -> str:
    """The worker's recommendation (its terminal line, `prediction.line` in decode_summary.json) as the
    description's Budget line; empty where the run predicted nothing."""
    line = (document.get("prediction") or {}).get("line")
    if not line and document.get("curve_withheld"):
        line = f"not predicted: {document['curve_withheld']}, so no round could hold a whole tree"
    return f"Budget: {line}." if line else ""


def budget_csv(document: dict[str, Any]) -> str | None:
    """Every budget's figures (`CSV_HEADER`), or None without a curve."""
    if not document.get("budget_curve"):
        return None
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(CSV_HEADER)
    for row in _rows(document):
        writer.writerow(["" if row[key] is None else row[key] for key in CSV_HEADER])
    return buffer.getvalue()
