"""The sweep's figure: every job's tau and speedup against tree budget, drawn into the parent run."""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.sweep.rows import Row
from orchestrator.tracking.plots import VIEWER_WIDTH_IN, budget_axis, pyplot, save_figure

if TYPE_CHECKING:
    import matplotlib.pyplot as plt


def plot_sweep(rows: list[Row], out_dir: Path) -> list[Path]:
    """The sweep's figure as `sweep_tau_speedup_vs_budget.png` in `out_dir` (none when no job ran DDTree)."""
    fig = draw_sweep(rows)
    return [] if fig is None else [save_figure(fig, out_dir / "sweep_tau_speedup_vs_budget.png")]


def draw_sweep(rows: list[Row]) -> plt.Figure | None:
    """tau and speedup against tree budget, one row of panels per model and one line per job; each job's
    DFlash as a dashed line of the same colour and AR (tau 1, speedup 1) dotted, on both panels; the legend
    beside the panels, never over the data."""
    lines: dict[str, dict[str, list[Row]]] = defaultdict(lambda: defaultdict(list))
    dflash: dict[str, dict[str, Row]] = defaultdict(dict)
    for row in rows:
        label = f"#{row.job} {_without_model(row.varies)}"
        if row.kind == "ddtree" and row.tree_budget is not None and row.tau is not None:
            lines[row.model][label].append(row)
        elif row.kind == "dflash" and row.tau is not None:
            dflash[row.model][label] = row
    if not lines:
        return None
    # Two panels a row and the legend below: the artifact viewer's width (it shrank a 13-inch figure's labels).
    fig, axes = pyplot().subplots(2 * len(lines), 1, figsize=(VIEWER_WIDTH_IN, 7.0 * len(lines) + 1.0), squeeze=False)
    pairs = [(axes[2 * i][0], axes[2 * i + 1][0]) for i in range(len(lines))]
    for (model, jobs), panels in zip(sorted(lines.items()), pairs, strict=True):
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
            axis.axhline(1.0, linestyle=":", color="grey")  # AR: one token per round, speedup 1 by definition
            budget_axis(axis, budgets)
            axis.set_ylabel(label)
            axis.set_title(f"{model} (dashed: DFlash; dotted: AR)", fontsize="small")
        panels[1].legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    with warnings.catch_warnings():  # long job labels can leave no room to tighten: the figure is drawn all the same,
        warnings.filterwarnings("ignore", message="Tight layout not applied")  # not a line in the user's terminal
        fig.tight_layout()
    return fig


def _without_model(overrides: str) -> str:
    return " ".join(o for o in overrides.split() if not o.startswith("model=")) or "(defaults)"
