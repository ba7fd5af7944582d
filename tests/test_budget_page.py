"""The budget section of a job's page as the researcher reads it: the description's Budget line and table, the
CSV of every budget, the curve and prediction plot (its drawn lines), and the depth × rank heatmap (its cells)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.axes import Axes

from orchestrator.tracking.job_summary import summarize
from orchestrator.tracking.markdown_table import plain_markdown
from orchestrator.tracking.plots import HEATMAP_RANKS, draw_acceptance_profiles, draw_budget_curve, plot_decode_summary

LINE = (
    "on this host, budget 6 is predicted fastest: ×1.35 vs AR (±4 % at AR and the 2 budgets decoded; measured at 4: "
    "×1.20)"
)


def method(scope: str, name: str, budget: int, tau: float, speed: float, speedup: float) -> dict:
    return {"scope": scope, "method": name, "tree_budget": budget, "tau": tau, "tokens_per_s": speed,
            "speedup_vs_ar": speedup, "tokens_per_s_min": speed - 5, "tokens_per_s_max": speed + 5}  # fmt: skip


def document() -> dict:
    """A job with DDTree at budgets 4 and 8: tau at every budget from the budget-8 decode, and a prediction."""
    tau = [1.5, 1.9, 2.2, 2.4, 2.55, 2.65, 2.72, 2.8]
    predicted = [300.0, 340.0, 360.0, 370.0, 375.0, 378.0, 370.0, 350.0]
    return {
        "model": "tiny_trained",
        "dtype": "float32",
        "device": "cpu",
        "temperature": 0.0,
        "block_size": 8,
        "methods": [
            method("ar", "ar", 0, 1.0, 270.0, 1.0),
            method("dflash", "dflash", 0, 1.7, 260.0, 0.96),
            method("ddtree_tb4", "ddtree", 4, 2.3, 324.0, 1.2),
            method("ddtree_tb8", "ddtree", 8, 2.8, 310.0, 1.15),
        ],
        "best": {"scope": "ddtree_tb4", "fastest": "ddtree_tb4", "basis": "one pass"},
        "budget_curve": {
            "scope": "ddtree_tb8",
            "budget": 8,
            "rounds": 120,
            "tau": tau,
            "checks": [{"budget": 4, "estimate": 2.4, "measured": 2.3, "error": 2.4 - 2.3}],
        },
        "prediction": {
            "budgets": list(range(1, 9)),
            "tokens_per_s": predicted,
            "ar_tokens_per_s": 270.0,
            "ar_predicted_tokens_per_s": 280.0,
            "best_budget": 6,
            "best_tokens_per_s": 378.0,
            "best_speedup_vs_ar": 1.35,
            "checks": [
                {"budget": 0, "predicted_tokens_per_s": 280.0, "measured_tokens_per_s": 270.0, "error": 280 / 270 - 1},
                {"budget": 4, "predicted_tokens_per_s": 330.0, "measured_tokens_per_s": 324.0, "error": 330 / 324 - 1},
                {"budget": 8, "predicted_tokens_per_s": 350.0, "measured_tokens_per_s": 310.0, "error": 350 / 310 - 1},
            ],
            "error_worst": 350 / 310 - 1,
            "costs_kind": "eager",
            "tree_memory_mb": [0.01 * b for b in range(1, 9)],
            "cannot_tell": "",
            "line": LINE,
        },
        "acceptance_profiles": {
            "dflash": {"rounds": 10, "counts": [[6], [3], [1]], "reach": [0.6, 0.3, 0.1]},
            "ddtree_tb8": {"rounds": 10, "counts": [[5, 2, 0, 0, 0, 0, 0, 0, 1, 1], [4, 1]], "reach": [0.9, 0.5]},
        },
    }


def test_the_description_says_which_budget_to_use_before_the_tables() -> None:
    lines = plain_markdown(summarize(document(), "t").markdown).splitlines()
    assert lines[2].startswith("Best: **ddtree_tb4**")
    assert lines[4] == f"Budget: {LINE}."
    start = next(i for i, line in enumerate(lines) if line.startswith("**tau at every budget**"))
    assert "120 rounds of ddtree_tb8" in lines[start]
    header, rule, *rows = lines[start + 2 :]
    # powers of two, the budgets decoded (4, 8) and the predicted best (6)
    assert header == "| budget | 1 | 2 | 4 | 6 | 8 |" and rule == "| --- | --- | --- | --- | --- | --- |"
    assert rows == [
        "| tau, estimated | 1.50 | 1.90 | 2.40 | 2.65 | 2.80 |",
        "| tau, measured |  |  | 2.30 |  | 2.80 |",
        "| estimate − measured |  |  | +0.10 |  | +0.00 |",
        "| tok/s, predicted | 300 | 340 | 370 | 378 | 350 |",
        "| tok/s, measured |  |  | 324 |  | 310 |",
        "| prediction error (held out) |  |  | +2% |  | +13% |",
        "| tree memory, counted MB | 0.01 | 0.02 | 0.04 | 0.06 | 0.08 |",
    ]
    assert lines[start].endswith(
        "tok/s predicted from the eager rounds' costs measured between the prompts, with tau from the rounds of the "
        "smallest decoded budget at or above each; AR 270 tok/s measured, 280 predicted (+4%); each decoded "
        "budget's prediction made without its own rounds (the largest's: with them)"
    )


def test_the_budget_csv_has_every_budget() -> None:
    rows = list(csv.DictReader(io.StringIO(summarize(document(), "t").budget_csv or "")))
    assert [int(r["budget"]) for r in rows] == list(range(1, 9))
    assert rows[3]["tau_measured"] == "2.3" and float(rows[3]["tau_error"]) == pytest.approx(0.1)
    assert rows[4]["tau_measured"] == "" and float(rows[5]["predicted_tokens_per_s"]) == 378.0


def test_a_job_without_ddtree_has_no_budget_section() -> None:
    bare = {**document(), "budget_curve": None, "prediction": None}
    rendered = summarize(bare, "t")
    assert "Budget:" not in plain_markdown(rendered.markdown) and "tau at every budget" not in plain_markdown(
        rendered.markdown
    )
    assert rendered.budget_csv is None


def test_the_curve_and_the_prediction_are_drawn_beside_the_measured_points() -> None:
    summary = document()
    fig = draw_budget_curve(summary)
    left, right = fig.axes[:2]
    curve = next(line for line in left.get_lines() if line.get_label().startswith("estimated from DDTree 8"))
    assert list(curve.get_xdata()) == list(range(1, 9)) and list(curve.get_ydata()) == summary["budget_curve"]["tau"]
    predicted = next(line for line in right.get_lines() if line.get_label().startswith("predicted ("))
    assert list(predicted.get_ydata()) == summary["prediction"]["tokens_per_s"]
    best = next(line for line in right.get_lines() if line.get_label().startswith("predicted best: 6"))
    assert (list(best.get_xdata()), list(best.get_ydata())) == ([6], [378.0])
    measured = [line for line in right.get_lines() if line.get_marker() == "o"]
    assert [list(line.get_xdata()) for line in measured] == [[4, 8]]  # the real decodes, with their range
    assert [list(line.get_ydata()) for line in measured] == [[324.0, 310.0]]
    labels = {text.get_text() for text in right.get_legend().get_texts()}
    assert {"AR, measured", "AR, predicted", "DFlash, measured", "measured (range over passes)"} <= labels
    plt.close(fig)


def test_the_heatmap_cells_are_each_depth_and_rank_share_of_rounds() -> None:
    fig = draw_acceptance_profiles(document())
    panels = [axis for axis in fig.axes if axis.get_images()]
    assert [axis.get_title() for axis in panels] == ["DFlash · 10 rounds", "DDTree 8 · 10 rounds"]
    grid = panels[1].get_images()[0].get_array()
    assert grid.shape == (3, HEATMAP_RANKS)  # the deepest method's depths, ranks 0–6 and "≥7"
    assert list(grid[0]) == pytest.approx([50, 20, 0, 0, 0, 0, 0, 20])  # percent; ranks 8 and 9 summed into ≥7
    assert list(grid[1][:2]) == pytest.approx([40, 10]) and list(grid[2]) == [0] * HEATMAP_RANKS
    assert [tick.get_text() for tick in panels[1].get_yticklabels()] == ["1 · 90%", "2 · 50%", "3 · 0%"]
    # The cells' numbers are readable on the page, and the colour bar reads in the percent they are written in.
    cells = [text for text in panels[1].texts if text.get_text()]
    assert [text.get_text() for text in cells[:2]] == ["50", "20"] and {t.get_fontsize() for t in cells} == {9}
    (bar,) = [axis for axis in fig.axes if not axis.get_images() and axis.get_label() == "<colorbar>"]
    assert bar.get_ylim() == pytest.approx((0, 100)) and "%" in bar.get_ylabel()
    plt.close(fig)


def test_the_tokens_per_s_panel_keeps_its_lines_off_the_frame_and_its_legend_off_the_lines() -> None:
    """A predicted AR faster than anything else (a busy host) sat on the frame, and the legend covered the
    baselines: the panel runs from 0 to a margin over its highest line, its legend below the plot."""
    summary = document()
    summary["prediction"]["ar_predicted_tokens_per_s"] = 2 * max(summary["prediction"]["tokens_per_s"])
    fig = draw_budget_curve(summary)
    right = fig.axes[1]
    fig.canvas.draw()
    low, high = right.get_ylim()
    tops = [max(line.get_ydata()) for line in right.get_lines()]
    assert low == 0 and max(tops) * 1.05 < high
    legend = right.get_legend().get_window_extent()
    assert legend.y1 <= right.get_window_extent().y0  # wholly below the plot's frame
    plt.close(fig)


def test_one_pass_is_not_drawn_as_a_range_over_repeats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each method's range over its passes is one value when it ran once: drawn as points, never labelled a
    range over repeats."""
    summary = document()
    for method in summary["methods"]:
        for key in ("tau", "speedup_vs_ar"):
            method[f"{key}_min"] = method[f"{key}_max"] = method.get(key, 1.0)
    summary["acceptance_lengths"] = {"dflash": [1, 2], "ddtree_tb8": [2, 3]}
    path = tmp_path / "decode_summary.json"
    path.write_text(json.dumps(summary))
    ranges: list[str] = []
    errorbar = Axes.errorbar
    monkeypatch.setattr(
        Axes, "errorbar", lambda self, *a, **k: ranges.append(k.get("label")) or errorbar(self, *a, **k)
    )
    plot_decode_summary(path, tmp_path)
    assert not any("range over repeats" in str(label) for label in ranges), ranges


def test_a_run_whose_drafts_were_never_accepted_still_gets_its_plots(tmp_path: Path) -> None:
    """A short decode with an untrained draft: every round accepted only the target's own token, so no method
    has a depth to draw. The heatmap is left out; the other plots are drawn (the run used to get none:
    `no plots: ... Invalid shape (0,) for image data`)."""
    summary = document()
    summary["acceptance_profiles"] = {s: {"rounds": 8, "counts": [], "reach": []} for s in ("dflash", "ddtree_tb8")}
    summary["acceptance_lengths"] = {"dflash": [0] * 8, "ddtree_tb8": [0] * 8}
    path = tmp_path / "decode_summary.json"
    path.write_text(json.dumps(summary))
    names = sorted(p.name for p in plot_decode_summary(path, tmp_path))
    assert "tau_speedup_vs_budget.png" in names and "acceptance_depth_rank.png" not in names
    summary["acceptance_profiles"]["dflash"] = {"rounds": 8, "counts": [[2, 1]], "reach": [0.375]}
    path.write_text(json.dumps(summary))
    assert "acceptance_depth_rank.png" in [p.name for p in plot_decode_summary(path, tmp_path)]


def test_no_best_is_starred_where_the_run_cannot_tell_and_memory_has_its_own_panel() -> None:
    summary = document()
    summary["prediction"]["cannot_tell"] = "its costs are of eager rounds, and this run decoded compiled ones"
    summary["methods"][0]["peak_memory_mb"] = 400.0  # AR's peak
    summary["methods"][2]["peak_memory_mb"] = 400.5
    summary["methods"][3]["peak_memory_mb"] = 401.0
    fig = draw_budget_curve(summary)
    speed, memory = fig.axes[1], fig.axes[2]
    assert not [line for line in speed.get_lines() if line.get_label().startswith("predicted best")]
    assert "cannot tell" in speed.get_title()
    counted = next(line for line in memory.get_lines() if line.get_label().startswith("tree, counted"))
    assert list(counted.get_ydata()) == summary["prediction"]["tree_memory_mb"]
    measured = next(line for line in memory.get_lines() if line.get_label().startswith("peak over AR's"))
    assert (list(measured.get_xdata()), list(measured.get_ydata())) == ([4, 8], [0.5, 1.0])
    plt.close(fig)


def test_a_curve_the_worker_withheld_is_one_line_saying_why() -> None:
    """A decode shorter than a draft block: the page's budget section and Budget line say why there is no curve
    and no prediction, and there is no budget CSV."""
    withheld = document() | {"budget_curve": None, "prediction": None}
    withheld["curve_withheld"] = "decode.max_new_tokens=6 is shorter than a draft block (8)"
    rendered = summarize(withheld, "t")
    text = plain_markdown(rendered.markdown)
    assert (
        "**tau at every budget**: not estimated: decode.max_new_tokens=6 is shorter than a draft block (8), so "
        "no round could hold a whole tree (decode more tokens for it)" in rendered.markdown
    )
    assert "Budget: not predicted: decode.max_new_tokens=6 is shorter than a draft block (8)" in text
    assert rendered.budget_csv is None
