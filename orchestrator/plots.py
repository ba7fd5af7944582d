"""Plots of a decode sweep, drawn on the orchestrator's side (the worker stays free of matplotlib)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from orchestrator.sweep.summary import Row

SUMMARY_FILE = "decode_summary.json"  # written by remote_worker.experiments.ddtree_gdn


NAMES = {"ar": "AR", "dflash": "DFlash", "ddtree": "DDTree"}


def method_label(scope: str) -> str:
    """`ddtree_tb32` → `DDTree 32`, `dflash` → `DFlash`: one spelling in every plot and legend."""
    name, _, budget = scope.partition("_tb")
    return f"{NAMES.get(name, name)} {budget}".strip()


def plot_decode_summary(summary_file: Path, out_dir: Path) -> list[Path]:
    """tau and speedup against tree budget (DFlash and AR as reference lines, the repeats' range as error
    bars), and the acceptance histogram; the run's context in each title."""
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    methods = summary["methods"]
    trees = sorted((m for m in methods if m["method"] == "ddtree"), key=lambda m: m["tree_budget"])
    reference = {m["method"]: m for m in methods if m["method"] in ("ar", "dflash")}
    context = _context(summary)
    figures = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    budgets = [m["tree_budget"] for m in trees]
    for axis, key, label in ((axes[0], "tau", "tau (tokens per round)"), (axes[1], "speedup_vs_ar", "speedup vs AR")):
        values = [m[key] for m in trees]
        low, high = f"{key}_min", f"{key}_max"
        if trees and all(low in m and high in m for m in trees):
            errors = [[m[key] - m[low] for m in trees], [m[high] - m[key] for m in trees]]
            axis.errorbar(budgets, values, yerr=errors, fmt="o-", capsize=3, label="DDTree (range over repeats)")
        else:
            axis.plot(budgets, values, "o-", label="DDTree")
        if "dflash" in reference:
            axis.axhline(reference["dflash"][key], linestyle="--", color="tab:orange", label="DFlash")
        axis.axhline(1.0, linestyle=":", color="grey", label="AR (= 1)")
        _budget_axis(axis, budgets)
        axis.set_ylabel(label)
        axis.legend(fontsize="small", loc="best")
    fig.suptitle(f"DDTree against tree budget · {context}", fontsize="medium")
    fig.tight_layout()
    figures.append(_save(fig, out_dir / "tau_speedup_vs_budget.png"))

    fig, axis = plt.subplots(figsize=(6.5, 4.4))
    lengths = summary["acceptance_lengths"]
    longest = max((max(v) for v in lengths.values() if v), default=0)
    bins = [b - 0.5 for b in range(longest + 2)]
    for scope, values in lengths.items():
        if scope != "ar" and values:
            axis.hist(values, bins=bins, histtype="step", density=True, label=method_label(scope))
    axis.set_xlabel("accepted draft tokens per round")
    axis.set_ylabel("share of rounds")
    axis.set_title(context, fontsize="small")
    axis.legend(fontsize="small")
    fig.tight_layout()
    figures.append(_save(fig, out_dir / "acceptance_length_hist.png"))
    return figures


def _context(summary: dict) -> str:
    """`tiny_trained · float32 · cpu · T=0 · block 8 · 3 repeats`, from what the worker wrote."""
    parts = [str(summary.get("model", "?"))]
    for key, form in (("dtype", "{}"), ("device", "{}"), ("temperature", "T={:g}"), ("block_size", "block {}")):
        if summary.get(key) is not None:
            parts.append(form.format(summary[key]))
    if summary.get("repeats", 1) and summary.get("repeats", 1) > 1:
        parts.append(f"{summary['repeats']} repeats")
    return " · ".join(parts)


def _budget_axis(axis: plt.Axes, budgets: list[int]) -> None:
    """Budgets double (16, 32, 64): a log₂ scale, labelled with the budgets themselves, not powers of two."""
    axis.set_xscale("log", base=2)
    if budgets:
        axis.set_xticks(budgets, [str(b) for b in budgets])
        axis.minorticks_off()
    axis.set_xlabel("tree budget (nodes)")


def plot_sweep(rows: list[Row], out_dir: Path) -> list[Path]:
    """tau and speedup against tree budget, one row of panels per model and one line per job; each job's
    DFlash as a dashed line of the same colour; the legend beside the panels, never over the data."""
    lines: dict[str, dict[str, list[Row]]] = defaultdict(lambda: defaultdict(list))
    dflash: dict[str, dict[str, Row]] = defaultdict(dict)
    for row in rows:
        label = f"#{row.job} {_without_model(row.varies)}"
        if row.tree_budget is not None and row.tau is not None:
            lines[row.model][label].append(row)
        elif row.method == "dflash" and row.tau is not None:
            dflash[row.model][label] = row
    if not lines:
        return []
    fig, axes = plt.subplots(len(lines), 2, figsize=(13, 3.8 * len(lines)), squeeze=False)
    for (model, jobs), panels in zip(sorted(lines.items()), axes, strict=True):
        budgets = sorted({r.tree_budget for points in jobs.values() for r in points if r.tree_budget})
        for axis, key, label in (
            (panels[0], "tau", "tau (tokens per round)"),
            (panels[1], "speedup_vs_ar", "speedup vs AR"),
        ):
            for job, points in sorted(jobs.items()):
                points.sort(key=lambda r: r.tree_budget)
                (line,) = axis.plot([r.tree_budget for r in points], [getattr(r, key) for r in points], "o-", label=job)
                reference = dflash[model].get(job)
                if reference is not None and getattr(reference, key) is not None:
                    axis.axhline(getattr(reference, key), linestyle="--", color=line.get_color(), linewidth=1)
            if key == "speedup_vs_ar":
                axis.axhline(1.0, linestyle=":", color="grey")
            _budget_axis(axis, budgets)
            axis.set_ylabel(label)
            axis.set_title(f"{model} (dashed: DFlash; dotted: AR)", fontsize="small")
        panels[1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    return [_save(fig, out_dir / "sweep_tau_speedup_vs_budget.png")]


def _without_model(overrides: str) -> str:
    return " ".join(o for o in overrides.split() if not o.startswith("model=")) or "(defaults)"


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
