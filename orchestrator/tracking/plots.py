"""Plots of a job's decode sweep, drawn on the orchestrator's side (the worker stays free of matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from remote_worker.decoding.figure_rules import ONLINE
from remote_worker.wording import counted

if TYPE_CHECKING:
    import matplotlib.pyplot as plt

SUMMARY_FILE = "decode_summary.json"  # written by remote_worker.experiments.ddtree_gdn


NAMES = {"ar": "AR", "dflash": "DFlash", "ddtree": "DDTree"}


# MLflow's artifact viewer shows an image at most its pane's width (about 840 px) and scales a wider one down,
# labels too: every figure is drawn that wide at the DPI it is saved with (`save_figure`).
VIEWER_WIDTH_IN = 7.6


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display: figures are files logged to MLflow), imported on first
    use: a command that draws nothing (`list`, `logs`, `cancel`, a dry run, a failed launch) does not pay the
    0.7 s of CPU its import costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    reference = {m["method"]: m for m in methods if m["method"] in ("ar", "dflash", ONLINE)}
    context = _context(summary)
    figures = []

    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(VIEWER_WIDTH_IN, 7.6))  # stacked: the artifact viewer's width
    budgets = [m["tree_budget"] for m in trees]
    for axis, key, label in ((axes[0], "tau", "tau (tokens per round)"), (axes[1], "speedup_vs_ar", "speedup vs AR")):
        values = [m[key] for m in trees]
        low, high = f"{key}_min", f"{key}_max"
        if trees and all(low in m and high in m for m in trees) and any(m[low] != m[high] for m in trees):
            errors = [[m[key] - m[low] for m in trees], [m[high] - m[key] for m in trees]]
            axis.errorbar(budgets, values, yerr=errors, fmt="o-", capsize=3, label="DDTree (range over repeats)")
        else:
            axis.plot(budgets, values, "o-", label="DDTree")
        if "dflash" in reference:
            axis.axhline(reference["dflash"][key], linestyle="--", color="tab:orange", label="DFlash")
        if key in reference.get(ONLINE, {}):
            axis.axhline(reference[ONLINE][key], linestyle="-.", color="tab:green",
                         label="DDTree-online (a budget per round)")  # fmt: skip
        axis.axhline(1.0, linestyle=":", color="grey", label="AR (= 1)")
        budget_axis(axis, budgets)
        axis.set_ylabel(label)
        axis.legend(fontsize="small", loc="best")
    fig.suptitle(f"DDTree against tree budget · {context}", fontsize="medium")
    fig.tight_layout()
    figures.append(save_figure(fig, out_dir / "tau_speedup_vs_budget.png"))

    fig, axis = plt.subplots(figsize=(min(6.5, VIEWER_WIDTH_IN), 4.4))
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
    if summary.get("budget_curve"):
        figures.append(save_figure(draw_budget_curve(summary), out_dir / "budget_curve.png"))
    if drawn_profiles(summary):
        figures.append(save_figure(draw_acceptance_profiles(summary), out_dir / "acceptance_depth_rank.png"))
    policy = (summary.get("online_budget") or {}).get(ONLINE)  # the one online method: its name, not the file's
    if isinstance(policy, dict) and policy.get("rounds_at_budget"):
        figures.append(save_figure(draw_online_budget(summary, ONLINE, policy), out_dir / f"{ONLINE}.png"))
    return figures


def draw_online_budget(summary: dict, scope: str, policy: dict) -> plt.Figure:
    """`ddtree_online`'s rounds: the share that verified each budget (the fastest fixed budget of the run
    marked), and its calibration curve, per depth: the drafter's guess for a step against the share of such
    steps accepted (on the diagonal: calibrated; below it: overconfident), each point sized by its nodes."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(VIEWER_WIDTH_IN, 7.6))
    counts = {int(n): int(c) for n, c in policy["rounds_at_budget"].items()}
    total = sum(counts.values()) or 1
    sizes = sorted(set(counts) | {int(n) for n in policy.get("sizes", [])})
    top.bar([str(n) for n in sizes], [counts.get(n, 0) / total for n in sizes], color="tab:green")
    method = next((m for m in summary.get("methods", []) if m.get("scope") == scope), {})
    best = method.get("best_fixed_budget")
    title = f"{counted(total, 'round')} · each tree grown as far as it may verify, at most {policy.get('largest')}"
    if best is not None and f"{int(best)}" in [str(n) for n in sizes]:
        top.axvline(sizes.index(int(best)), linestyle=":", color="grey", label=f"fastest fixed budget ({int(best)})")
        top.legend(fontsize="small", loc="best")
    if "speedup_vs_best_fixed" in method:
        title += f" · ×{method['speedup_vs_best_fixed']:.2f} the fastest fixed budget's speed"
    top.set_title(title, fontsize="small")
    top.set_xlabel("budget verified (nodes)")
    top.set_ylabel("share of rounds")
    curve = policy.get("calibration") or []
    bottom.plot([0, 1], [0, 1], linestyle=":", color="grey", label="calibrated")
    for depths in dict.fromkeys(row["depths"] for row in curve):
        rows = [row for row in curve if row["depths"] == depths]
        bottom.plot([r["predicted"] for r in rows], [r["accepted"] for r in rows], "-", alpha=0.5)
        bottom.scatter([r["predicted"] for r in rows], [r["accepted"] for r in rows],
                       s=[8 + 60 * min(r["nodes"], 400) / 400 for r in rows], label=f"depth {depths}")  # fmt: skip
    bottom.set_xlim(0, 1)
    bottom.set_ylim(0, 1)
    bottom.set_xlabel("drafter's guess for a step (mean in its bin)")
    bottom.set_ylabel("share of such steps accepted")
    bottom.legend(fontsize="small", loc="upper left", ncols=2)
    fig.suptitle(f"DDTree-online · {_context(summary)}", fontsize="medium")
    fig.tight_layout()
    return fig


def draw_budget_curve(summary: dict) -> plt.Figure:
    """Left: tau at every budget, estimated from the largest budget's decode, with the tau each real decode
    measured (its 95 % interval over prompts where it has one). Right, where the run measured its node costs:
    tokens/s predicted at every budget beside the measured tokens/s, AR and DFlash as reference lines, the
    predicted best budget marked where the run could tell it (the title says why not, where it could not).
    Third, where the run counted it: the tree's memory at every budget beside each decode's measured peak over
    AR's."""
    curve = summary["budget_curve"]
    prediction = summary.get("prediction")
    trees = sorted((m for m in summary["methods"] if m["method"] == "ddtree"), key=lambda m: m["tree_budget"])
    reference = {m["method"]: m for m in summary["methods"] if m["method"] in ("ar", "dflash")}
    budgets = list(range(1, len(curve["tau"]) + 1))
    memory = (prediction or {}).get("tree_memory_mb") or []
    panels = 1 + bool(prediction) + bool(memory)
    # One panel a row, each the artifact viewer's width: side by side (1914 px) they shrank to unreadable labels.
    fig, rows = pyplot().subplots(panels, 1, figsize=(VIEWER_WIDTH_IN, 4.6 * panels), squeeze=False)
    axes = [[row[0] for row in rows]]
    axis = axes[0][0]
    axis.plot(budgets, curve["tau"], "-", label=f"estimated from {method_label(curve['scope'])}'s rounds")
    _measured_points(axis, trees, "tau", "measured")
    if "dflash" in reference:
        axis.axhline(reference["dflash"]["tau"], linestyle="--", color="tab:orange", label="DFlash")
    ticks = sorted({*(2**k for k in range(len(budgets).bit_length()) if 2**k <= budgets[-1]), budgets[-1]})
    budget_axis(axis, sorted({*ticks, *(m["tree_budget"] for m in trees)}))
    axis.set_ylabel("tau (tokens per round)")
    axis.set_title(f"tau at every budget, from {curve['rounds']} rounds", fontsize="small")
    axis.legend(fontsize="small", loc="lower right")
    if prediction:
        axis = axes[0][1]
        axis.plot(prediction["budgets"], prediction["tokens_per_s"], "-", label="predicted (tau / node costs)")
        _measured_points(axis, trees, "tokens_per_s", "measured")
        best = prediction["best_budget"]
        if not prediction.get("cannot_tell") and prediction.get("no_single") and prediction.get("within"):
            low, high = prediction["within"][0], prediction["within"][-1]  # one budget cannot be named: the range
            error = max(abs(c["error"]) for c in prediction["checks"] if c["budget"])
            axis.axvspan(low - 0.5, high + 0.5, color="tab:red", alpha=0.12,
                         label=f"within ±{100 * error:.0f} % of the best predicted: {low}–{high}")  # fmt: skip
        elif not prediction.get("cannot_tell"):
            error = prediction.get("error_worst")
            within = f", ±{100 * error:.0f} %" if error is not None else ""
            label = f"predicted best: {best} (×{prediction['best_speedup_vs_ar']:.2f} vs AR{within})"
            axis.plot([best], [prediction["best_tokens_per_s"]], "*", markersize=13, color="tab:red", label=label)
        if "ar" in reference:
            axis.axhline(reference["ar"]["tokens_per_s"], linestyle=":", color="grey", label="AR, measured")
        if prediction.get("ar_predicted_tokens_per_s"):
            axis.axhline(prediction["ar_predicted_tokens_per_s"], linestyle="-.", color="grey", alpha=0.6,
                         label="AR, predicted")  # fmt: skip
        if "dflash" in reference:
            dflash = reference["dflash"]["tokens_per_s"]
            axis.axhline(dflash, linestyle="--", color="tab:orange", label="DFlash, measured")
        budget_axis(axis, sorted({*ticks, *(m["tree_budget"] for m in trees)}))
        axis.set_ylabel("decode tokens/s")
        title = "tokens/s against budget on this host"
        if prediction.get("cannot_tell"):
            title += "\nno best marked: the prediction cannot tell it"
        axis.set_title(title, fontsize="small")
        # From 0 to a margin over the highest line, error bars included: no reference line on the frame.
        axis.set_ylim(0, TOP_MARGIN * max(_drawn_top(axis), 1e-9))
        # Below the plot, never over a line: the baselines run the whole width, where "best" put it on them.
        axis.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    if memory:
        ticks = sorted({*ticks, *(m["tree_budget"] for m in trees)})
        _memory_panel(axes[0][-1], prediction, trees, reference.get("ar"), ticks, str(summary.get("device", "")))
    fig.suptitle(f"DDTree budgets · {_context(summary)}", fontsize="medium")
    fig.tight_layout()
    return fig


TOP_MARGIN = 1.12  # the tokens/s panel's top, over its highest line


def _memory_panel(
    axis: plt.Axes, prediction: dict, trees: list[dict], ar: dict | None, ticks: list[int], device: str
) -> None:
    """The tree's memory at every budget as `tree_memory` counts it (a lower bound), and where the run decoded,
    each decode's measured peak over AR's (what the tree added, as the peak measure sees it: on a CPU the
    process's peak resident size, in which the allocator's reuse of freed memory hides a small tree)."""
    memory = prediction["tree_memory_mb"]
    axis.plot(prediction["budgets"][: len(memory)], memory, "-", label="tree, counted (lower bound)")
    if ar is not None and "peak_memory_mb" in ar:
        decoded = [m for m in trees if "peak_memory_mb" in m]
        extra = [m["peak_memory_mb"] - ar["peak_memory_mb"] for m in decoded]
        label = "peak over AR's, measured" + (" (process resident size)" if device.startswith("cpu") else "")
        axis.plot([m["tree_budget"] for m in decoded], extra, "o", color="tab:green", label=label)
    budget_axis(axis, ticks)
    axis.set_ylabel("MB")
    axis.set_title("memory a round adds against budget", fontsize="small")
    axis.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False)


def _drawn_top(axis: plt.Axes) -> float:
    """The highest y of everything drawn on `axis`: lines, markers, reference lines and error bars."""
    tops = [float(max(line.get_ydata())) for line in axis.get_lines() if len(line.get_ydata())]
    for collection in axis.collections:  # error bars
        for segment in collection.get_segments():
            tops += [float(y) for _, y in segment]
    return max(tops, default=0.0)


def _measured_points(axis: plt.Axes, trees: list[dict], key: str, label: str) -> None:
    """The real decodes' figures at their budgets, with their 95 % interval over prompts where they have one
    (tau), else the range over the passes where there were several (tokens/s)."""
    if not trees:
        return
    budgets, values = [m["tree_budget"] for m in trees], [m[key] for m in trees]
    for low, high, what in ((f"{key}_ci_low", f"{key}_ci_high", "95 % interval over prompts"),
                            (f"{key}_min", f"{key}_max", "range over passes")):  # fmt: skip
        if all(low in m and high in m for m in trees) and any(m[low] != m[high] for m in trees):
            errors = [[m[key] - m[low] for m in trees], [m[high] - m[key] for m in trees]]
            axis.errorbar(budgets, values, yerr=errors, fmt="o", capsize=3, color="tab:green",
                          label=f"{label} ({what})")  # fmt: skip
            return
    axis.plot(budgets, values, "o", color="tab:green", label=label)


# Ranks from this one on are summed into the last column of the heatmap ("≥7"): the draft's later choices are rare.
HEATMAP_RANKS = 8
HEATMAP_COLUMNS = 3  # panels per row: a page shows the figure at its width, six panels in a row are unreadable
HEATMAP_FONT = 9  # points: the cells' numbers, readable where the page shrinks the figure to its width


def drawn_profiles(summary: dict) -> dict[str, dict]:
    """The methods whose rounds accepted a drafted token at least once: a method that never did (a short decode
    with an untrained draft) has no depth to draw, and is left out rather than leaving the run without plots."""
    profiles = (summary.get("acceptance_profiles") or {}).items()
    return {scope: p for scope, p in profiles if p and p.get("rounds") and p.get("counts")}


def draw_acceptance_profiles(summary: dict) -> plt.Figure:
    """Per drafting method, a depth × rank heatmap: the share of rounds whose accepted path took the draft's
    rank-r candidate at depth d, written in every cell of 1 % or more. A row sums to the share of rounds that
    reach that depth (beside the depth). Mass in rank 0 fading with depth asks for a deeper tree; mass past
    rank 0, a wider one. The colour scale is a square root, so the small shares past rank 0 show."""
    from matplotlib.colors import PowerNorm

    profiles = drawn_profiles(summary)
    depth = max(len(p["counts"]) for p in profiles.values())
    columns = min(len(profiles), HEATMAP_COLUMNS)
    rows = -(-len(profiles) // columns)
    size = (4.0 * columns + 1.2, (0.4 * depth + 1.5) * rows + 0.5)
    fig, axes = pyplot().subplots(rows, columns, figsize=size, squeeze=False, layout="constrained")
    panels = [axis for row in axes for axis in row]
    for axis in panels[len(profiles) :]:
        axis.set_visible(False)
    image = None
    for axis, (scope, profile) in zip(panels, profiles.items(), strict=False):
        grid = [[0.0] * HEATMAP_RANKS for _ in range(depth)]  # percent of rounds, as the colour bar reads
        for d, row in enumerate(profile["counts"]):
            for rank, count in enumerate(row):
                grid[d][min(rank, HEATMAP_RANKS - 1)] += 100 * count / profile["rounds"]
        image = axis.imshow(grid, cmap="viridis", norm=PowerNorm(0.5, vmin=0, vmax=100), aspect="auto")
        for d, row in enumerate(grid):
            for rank, share in enumerate(row):
                if share >= 1:
                    colour = "black" if share > 30 else "white"
                    axis.text(rank, d, f"{share:.0f}", ha="center", va="center", fontsize=HEATMAP_FONT, color=colour)
        reach = list(profile.get("reach") or [])
        reach += [0.0] * (depth - len(reach))
        axis.set_xticks(range(HEATMAP_RANKS), [*map(str, range(HEATMAP_RANKS - 1)), f"≥{HEATMAP_RANKS - 1}"])
        axis.set_yticks(range(depth), [f"{d + 1} · {share:.0%}" for d, share in enumerate(reach)])
        axis.set_xlabel("draft's rank of the accepted token")
        axis.set_title(f"{method_label(scope)} · {profile['rounds']} rounds", fontsize="small")
    for row in axes:
        row[0].set_ylabel("depth · share reaching it")
    if image is not None:
        fig.colorbar(image, ax=panels, label="share of rounds (%, also in the cells)", fraction=0.03)
    fig.suptitle(f"Where acceptance comes from · {_context(summary)}", fontsize="medium")
    return fig


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
    pyplot().close(fig)
    return path
