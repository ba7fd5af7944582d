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


def plot_decode_summary(summary_file: Path, out_dir: Path) -> list[Path]:
    """tau and speedup against tree budget (DFlash and AR as reference lines), and the acceptance histogram."""
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    methods = summary["methods"]
    trees = sorted((m for m in methods if m["method"] == "ddtree"), key=lambda m: m["tree_budget"])
    reference = {m["method"]: m for m in methods if m["method"] in ("ar", "dflash")}
    figures = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key, label in ((axes[0], "tau", "tau (tokens per round)"), (axes[1], "speedup_vs_ar", "speedup vs AR")):
        axis.plot([m["tree_budget"] for m in trees], [m[key] for m in trees], "o-", label="DDTree")
        for name, style in (("dflash", "--"), ("ar", ":")):
            if name in reference:
                axis.axhline(reference[name][key], linestyle=style, color="grey", label=name.upper())
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tree budget (nodes)")
        axis.set_ylabel(label)
        axis.legend()
    fig.suptitle(f"{summary['model']}: DDTree against tree budget")
    fig.tight_layout()
    figures.append(_save(fig, out_dir / "tau_speedup_vs_budget.png"))

    fig, axis = plt.subplots(figsize=(6, 4))
    lengths = summary["acceptance_lengths"]
    longest = max((max(v) for v in lengths.values() if v), default=0)
    bins = [b - 0.5 for b in range(longest + 2)]
    for scope, values in lengths.items():
        if scope != "ar" and values:
            axis.hist(values, bins=bins, histtype="step", density=True, label=scope)
    axis.set_xlabel("accepted draft tokens per round")
    axis.set_ylabel("share of rounds")
    axis.legend()
    fig.tight_layout()
    figures.append(_save(fig, out_dir / "acceptance_length_hist.png"))
    return figures


def plot_sweep(rows: list[Row], out_dir: Path) -> list[Path]:
    """tau and speedup against tree budget, one row of panels per model and one line per job."""
    lines: dict[str, dict[str, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.tree_budget is not None and row.tau is not None:
            lines[row.model][f"#{row.job} {_without_model(row.varies)}"].append(row)
    if not lines:
        return []
    fig, axes = plt.subplots(len(lines), 2, figsize=(10, 3.5 * len(lines)), squeeze=False)
    for (model, jobs), panels in zip(sorted(lines.items()), axes, strict=True):
        for axis, key, label in (
            (panels[0], "tau", "tau (tokens per round)"),
            (panels[1], "speedup_vs_ar", "speedup vs AR"),
        ):
            for job, points in sorted(jobs.items()):
                points.sort(key=lambda r: r.tree_budget)
                axis.plot([r.tree_budget for r in points], [getattr(r, key) for r in points], "o-", label=job)
            axis.set_xscale("log", base=2)
            axis.set_xlabel("tree budget (nodes)")
            axis.set_ylabel(label)
            axis.set_title(model)
            axis.legend(fontsize="small")
    fig.tight_layout()
    return [_save(fig, out_dir / "sweep_tau_speedup_vs_budget.png")]


def _without_model(overrides: str) -> str:
    return " ".join(o for o in overrides.split() if not o.startswith("model=")) or "(defaults)"


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
