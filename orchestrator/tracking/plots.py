"""Plots of a job's decode sweep, drawn on the orchestrator's side (the worker stays free of matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

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
        budget_axis(axis, budgets)
        axis.set_ylabel(label)
        axis.legend(fontsize="small", loc="best")
    fig.suptitle(f"DDTree against tree budget · {context}", fontsize="medium")
    fig.tight_layout()
    figures.append(save_figure(fig, out_dir / "tau_speedup_vs_budget.png"))

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
    figures.append(save_figure(fig, out_dir / "acceptance_length_hist.png"))
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


def budget_axis(axis: plt.Axes, budgets: list[int]) -> None:
    """Budgets double (16, 32, 64): a log₂ scale, labelled with the budgets themselves, not powers of two."""
    axis.set_xscale("log", base=2)
    if budgets:
        axis.set_xticks(budgets, [str(b) for b in budgets])
        axis.minorticks_off()
    axis.set_xlabel("tree budget (nodes)")


def save_figure(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
