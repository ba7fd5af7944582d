"""What the job's page says: the summary table, the generations table, the run's name."""

from __future__ import annotations

import csv
import io
import json
import random
import re
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from markdown_it import MarkdownIt

from orchestrator import CONF_DIR
from orchestrator.config.validation import validate
from orchestrator.tracking.job_summary import generation_rows, summarize
from orchestrator.tracking.markdown_table import plain_markdown
from orchestrator.tracking.runs import run_name
from remote_worker.experiments.decode_report import headline_metrics
from remote_worker.experiments.decode_report import terminal_summary as _terminal_summary
from remote_worker.experiments.verdict import best_record, judge

BASIS = (
    "its interval clears the runner-up's: ddtree_tb32 ×2.50 (2.31–2.70) against dflash ×2.20 (2.05–2.29), 95 % "
    "intervals over 8 prompts"
)

SUMMARY = {
    "model": "tiny_trained",
    "methods": [
        {"scope": "ar", "method": "ar", "tree_budget": None, "tau": 1.0, "tokens_per_s": 100.0,
         "tokens_per_s_min": 95.0, "tokens_per_s_max": 104.0, "speedup_vs_ar": 1.0, "lossless": 1.0,
         "near_tie_divergences": 0.0, "unexplained_divergences": 0.0},
        {"scope": "dflash", "method": "dflash", "tree_budget": None, "tau": 3.4, "tokens_per_s": 220.0,
         "tokens_per_s_min": 210.0, "tokens_per_s_max": 230.0, "speedup_vs_ar": 2.2, "lossless": 1.0,
         "near_tie_divergences": 0.0, "unexplained_divergences": 0.0},
        {"scope": "ddtree_tb32", "method": "ddtree", "tree_budget": 32, "tau": 4.5, "tokens_per_s": 250.0,
         "tokens_per_s_min": 240.0, "tokens_per_s_max": 260.0, "speedup_vs_ar": 2.5, "lossless": 0.5,
         "near_tie_divergences": 1.0, "unexplained_divergences": 0.0},
    ],
    "best": {"scope": "ddtree_tb32", "fastest": "ddtree_tb32", "basis": BASIS},
}  # fmt: skip


def test_the_table_has_a_row_per_method_in_order_and_names_the_best() -> None:
    rendered = summarize(SUMMARY, "tiny_trained · float32 · T=0 · local")
    rows = [
        line for line in plain_markdown(rendered.markdown).splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert [row.split("|")[1].strip() for row in rows] == ["method", "ar", "dflash", "ddtree_tb32"]
    assert "| ddtree_tb32 | 4.50 | 250.0 | 240.0–260.0 | ×2.50 |" in plain_markdown(rendered.markdown)
    assert "1 / 0" in plain_markdown(rendered.markdown)  # near tie / unexplained
    assert plain_markdown(rendered.markdown).splitlines()[2] == (  # under the answer: what MLflow shows collapsed
        f"Best: **ddtree_tb32**, ×2.50 vs AR at tau 4.50 — {BASIS}."
    )
    table = list(csv.DictReader(io.StringIO(rendered.csv)))
    assert [r["method"] for r in table] == ["ar", "dflash", "ddtree_tb32"] and table[2]["tree_budget"] == "32"


def test_the_description_answers_first_then_a_table_markdown_reads_as_columns() -> None:
    lines = plain_markdown(summarize(SUMMARY, "tiny_trained · float32 · T=0 · local").markdown).splitlines()
    assert (
        lines[0] == "**DDTree-32**: tau 4.50, ×2.50 vs AR, lossless 0.50 · **DFlash**: tau 3.40, ×2.20 vs AR, lossless"
    )
    table = [line for line in lines if line.startswith("|")]
    assert table[1] == "|" + " --- |" * (table[0].count("|") - 1)  # one separator cell per column
    # MLflow's converter (showdown, GitHub flavour) reads a table only between blank lines (or the text's end)
    assert lines[lines.index(table[0]) - 1] == "" and lines[lines.index(table[-1]) + 1 :] in ([], [""])
    html = MarkdownIt("commonmark").enable("table").render("\n".join(lines))
    assert re.findall(r"<th>(.*?)</th>", html)[:5] == ["method", "tau", "decode tok/s", "range", "speedup vs AR"]
    first_row = re.search(r"<tbody>\s*<tr>(.*?)</tr>", html, re.S)
    assert first_row and re.findall(r"<td>(.*?)</td>", first_row.group(1))[:4] == ["ar", "1.00", "100.0", "95.0–104.0"]


def test_the_range_is_at_the_medians_precision_and_holds_it() -> None:
    method = {"scope": "ar", "tokens_per_s": 8.6, "tokens_per_s_min": 8.55, "tokens_per_s_max": 9.2}
    row = next(
        line
        for line in plain_markdown(summarize({"methods": [method]}, "t").markdown).splitlines()
        if line.startswith("| ar")
    )
    assert row == "| ar | 8.6 | 8.6–9.2 |"
    once = {**method, "tokens_per_s_min": 8.6, "tokens_per_s_max": 8.6}  # one pass: a range would only repeat it
    assert "| method | decode tok/s |" in plain_markdown(summarize({"methods": [once]}, "t").markdown).splitlines()
    rng = random.Random(0)
    for _ in range(2000):  # whatever the spread, the median printed lies inside the range printed beside it
        low, median, high = sorted(rng.uniform(0, 50) for _ in range(3))
        method = {"scope": "ar", "tokens_per_s": median, "tokens_per_s_min": low, "tokens_per_s_max": high}
        row = next(
            line
            for line in plain_markdown(summarize({"methods": [method]}, "t").markdown).splitlines()
            if "| ar" in line
        )
        shown, spread = row.split(" | ")[1:3]
        assert float(spread.split("–")[0]) <= float(shown) <= float(spread.split("–")[1].rstrip(" |")), row


def _with_intervals() -> dict[str, Any]:
    """SUMMARY as a run of several prompts leaves it: 95 % intervals over prompts for the drafting methods, and
    DDTree against DFlash."""
    intervals = {
        "dflash": {"tau_ci_low": 3.12, "tau_ci_high": 3.48,
                   "speedup_vs_ar_ci_low": 2.05, "speedup_vs_ar_ci_high": 2.31},
        "ddtree_tb32": {"tau_ci_low": 4.2, "tau_ci_high": 4.81,
                        "speedup_vs_ar_ci_low": 2.31, "speedup_vs_ar_ci_high": 2.7,
                        "speedup_vs_dflash": 1.12, "speedup_vs_dflash_ci_low": 1.05, "speedup_vs_dflash_ci_high": 1.2},
    }  # fmt: skip
    return {**SUMMARY, "methods": [{**m, **intervals.get(m["scope"], {})} for m in SUMMARY["methods"]]}


def test_the_intervals_over_prompts_are_columns_of_the_table_and_the_csv() -> None:
    rendered = summarize(_with_intervals(), "t")
    lines = plain_markdown(rendered.markdown).splitlines()
    assert lines[0] == plain_markdown(summarize(SUMMARY, "t").markdown).splitlines()[0]  # the answer's line stays short
    header = next(line for line in lines if line.startswith("| method"))
    assert header.startswith(
        "| method | tau | tau 95% CI | decode tok/s | range | speedup vs AR | speedup 95% CI | vs DFlash |"
    )
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines if line.startswith("| ")}
    assert rows["ar"].startswith("| ar | 1.00 |  | 100.0 | 95.0–104.0 | ×1.00 |  |  |")  # AR: 1 by definition
    assert rows["dflash"].startswith("| dflash | 3.40 | 3.12–3.48 | 220.0 | 210.0–230.0 | ×2.20 | ×2.05–2.31 |  |")
    assert "| ×2.50 | ×2.31–2.70 | ×1.12 (1.05–1.20) |" in rows["ddtree_tb32"]
    html = MarkdownIt("commonmark").enable("table").render(plain_markdown(rendered.markdown))
    assert "<th>vs DFlash</th>" in html and "<td>×1.12 (1.05–1.20)</td>" in html  # still one table
    table = list(csv.DictReader(io.StringIO(rendered.csv)))
    keys = ("tau_ci_low", "tau_ci_high", "speedup_vs_ar_ci_low", "speedup_vs_ar_ci_high", "speedup_vs_dflash",
            "speedup_vs_dflash_ci_low", "speedup_vs_dflash_ci_high")  # fmt: skip
    assert [table[2][k] for k in keys] == ["4.2", "4.81", "2.31", "2.7", "1.12", "1.05", "1.2"]
    assert all(table[0][k] == "" for k in keys) and table[1]["speedup_vs_dflash"] == ""


def test_without_intervals_no_interval_columns_and_ddtree_over_dflash_alone() -> None:
    """One prompt: no interval (no spread to resample), but DDTree's speedup over DFlash is still a figure."""
    one = {**SUMMARY, "methods": [{**m, "speedup_vs_dflash": 1.14} if m["method"] == "ddtree" else m
                                  for m in SUMMARY["methods"]]}  # fmt: skip
    markdown = plain_markdown(summarize(one, "t").markdown)
    assert "95% CI" not in markdown and "| vs DFlash |" in markdown
    assert "| ×2.50 | ×1.14 |" in markdown
    assert "vs DFlash" not in plain_markdown(summarize(SUMMARY, "t").markdown)


def test_the_job_run_and_the_terminal_carry_the_intervals() -> None:
    methods = _with_intervals()["methods"]
    summary = {m["scope"]: {k: v for k, v in m.items() if isinstance(v, float)} for m in methods}
    headline, _ = headline_metrics(summary)
    assert headline["ddtree_tb32.tau_ci_low"] == 4.2 and headline["dflash.speedup_vs_ar_ci_high"] == 2.31
    assert (
        headline["ddtree_tb32.speedup_vs_dflash"] == 1.12 and headline["ddtree_tb32.speedup_vs_dflash_ci_low"] == 1.05
    )
    assert "ar.tau_ci_low" not in headline
    lines = _terminal_summary({scope: {**m, "repetition_share": 0.0} for scope, m in summary.items()})
    assert lines["ddtree_tb32"].startswith(
        "tau 4.50 (4.20–4.81) · 250.0 tok/s · ×2.50 (2.31–2.70) vs AR · ×1.12 (1.05–1.20) vs DFlash · repetition"
    )
    assert lines["ar"].startswith("tau 1.00 · 100.0 tok/s · ×1.00 vs AR · repetition")


def _method(scope: str, speedup: float, low: float | None, high: float | None, prompts: int) -> dict[str, Any]:
    """A method's figures: its speedup and, where `low` is given, its 95 % interval over `prompts` prompts."""
    figures = {"scope": scope, "method": scope.split("_")[0], "tau": 2.0 if scope != "ar" else 1.0,
               "tokens_per_s": 100 * speedup, "speedup_vs_ar": speedup, "prompts": float(prompts)}  # fmt: skip
    if low is not None and scope != "ar":
        figures.update(speedup_vs_ar_ci_low=low, speedup_vs_ar_ci_high=high)
    return figures


def _what_the_job_says(*methods: dict[str, Any]) -> tuple[str, str, dict[str, float]]:
    """The description's Best line, the terminal's `best` row and the `best.*` metrics, for a worker summary."""
    summary = {m["scope"]: {k: v for k, v in m.items() if isinstance(v, float)} for m in methods}
    headline, verdict = headline_metrics(summary)
    document = {"methods": list(methods), "best": best_record(verdict)}
    line = plain_markdown(summarize(document, "t").markdown).splitlines()[2]
    row = _terminal_summary({scope: {**m, "repetition_share": 0.0} for scope, m in summary.items()}, verdict)
    return line, row["best"], {k: v for k, v in headline.items() if k.startswith("best.")}


def test_a_method_is_crowned_only_where_its_interval_clears_the_runner_ups() -> None:
    ar = _method("ar", 1.0, None, None, 8)
    line, row, best = _what_the_job_says(
        ar, _method("dflash", 1.5, 1.3, 1.7, 8), _method("ddtree_tb32", 2.0, 1.8, 2.2, 8)
    )
    assert line == (
        "Best: **ddtree_tb32**, ×2.00 vs AR at tau 2.00 — its interval clears the runner-up's: ddtree_tb32 ×2.00 "
        "(1.80–2.20) against dflash ×1.50 (1.30–1.70), 95 % intervals over 8 prompts."
    )
    assert row == line.removeprefix("Best: ").replace("**", "").removesuffix(".")
    assert best == {"best.speedup_vs_ar": 2.0, "best.tau": 2.0, "best.tokens_per_s": 200.0}
    # the sweep's own case: a fastest whose interval (0.73–1.80) overlaps the runner-up's is not crowned
    line, row, best = _what_the_job_says(
        ar, _method("dflash", 1.1, 0.8, 1.5, 8), _method("ddtree_tb32", 1.25, 0.73, 1.80, 8)
    )
    assert line == (
        "Best: no method is clearly ahead: ddtree_tb32 ×1.25 (0.73–1.80) overlaps dflash ×1.10 (0.80–1.50), "
        "95 % intervals over 8 prompts."
    )
    assert row == line.removeprefix("Best: ").removesuffix(".")
    assert best == {}  # no best.* figures where no method is named


def test_under_five_prompts_nothing_is_crowned_and_the_count_is_said() -> None:
    line, _, best = _what_the_job_says(
        _method("ar", 1.0, None, None, 3),
        _method("dflash", 1.5, None, None, 3),
        _method("ddtree_tb32", 2.5, None, None, 3),
    )
    assert line == (  # the leader and runner-up named, as the sweep's page names them, but not crowned
        "Best: no method is crowned: ddtree_tb32 ×2.50 leads dflash ×1.50 on 3 prompts, too few for a 95 % "
        "interval (at least 5)."
    )
    assert best == {}
    summary = {"ar": {"tau": 1.0, "tokens_per_s": 100.0, "speedup_vs_ar": 1.0, "repetition_share": 0.0, "prompts": 3.0},
               "dflash": {"tau": 2.0, "tokens_per_s": 150.0, "speedup_vs_ar": 1.5, "repetition_share": 0.0,
                          "prompts": 3.0}}  # fmt: skip
    lines = _terminal_summary(summary)
    assert "3 prompts, too few for a 95 % interval" in lines["dflash"] and "too few" not in lines["ar"]
    page = plain_markdown(summarize({"methods": [{"scope": k, **v} for k, v in summary.items()]}, "t").markdown)
    assert "No 95 % intervals: the figures rest on 3 prompts, too few for one (at least 5)." in page


def test_a_slowdown_is_never_best_without_saying_it_is_slower_than_ar() -> None:
    line, row, best = _what_the_job_says(_method("ar", 1.0, None, None, 8), _method("dflash", 0.47, 0.4, 0.55, 8))
    assert line == (
        "Best: **dflash**, ×0.47 vs AR at tau 2.00 — slower than AR, as is every drafting method here; the only "
        "drafting method."
    )
    assert "slower than AR" in row
    line, _, best = _what_the_job_says(
        _method("ar", 1.0, None, None, 8),
        _method("dflash", 0.6, 0.5, 0.7, 8),
        _method("ddtree_tb32", 0.65, 0.55, 0.8, 8),
    )
    assert line == (
        "Best: no method is clearly ahead: ddtree_tb32 ×0.65 (0.55–0.80) overlaps dflash ×0.60 (0.50–0.70), 95 % "
        "intervals over 8 prompts; every drafting method is slower than AR."
    )
    assert best == {}
    assert judge({"ar": {"speedup_vs_ar": 1.0}}) is None  # AR alone: nothing to name


def test_at_temperature_above_zero_the_exactness_columns_are_left_out() -> None:
    hot = {"methods": [{k: v for k, v in m.items() if "lossless" not in k and "divergences" not in k}
                       for m in SUMMARY["methods"]]}  # fmt: skip
    assert "lossless" not in plain_markdown(summarize(hot, "t").markdown)


def test_the_jobs_metrics_lead_with_the_best_then_each_figure_across_methods() -> None:
    summary = {m["scope"]: {k: v for k, v in m.items() if isinstance(v, float)} for m in SUMMARY["methods"]}
    summary["dflash"].update(speedup_vs_ar_ci_low=2.05, speedup_vs_ar_ci_high=2.29, prompts=8.0)
    summary["ddtree_tb32"].update(speedup_vs_ar_ci_low=2.31, speedup_vs_ar_ci_high=2.7, prompts=8.0)
    headline, verdict = headline_metrics(summary)
    assert verdict is not None and verdict.best == "ddtree_tb32"
    assert list(headline)[:7] == [  # the order the job's run page lists them in (first logged, first listed)
        "best.speedup_vs_ar", "best.tau", "best.tokens_per_s",
        "dflash.tau", "ddtree_tb32.tau",
        "dflash.speedup_vs_ar", "ddtree_tb32.speedup_vs_ar",
    ]  # fmt: skip
    assert headline["best.speedup_vs_ar"] == 2.5 and headline["ar.tokens_per_s"] == 100.0
    # AR's figures that are 1 by definition are no headline: charts sort `ar.*` first, ahead of what varies
    assert not {"ar.tau", "ar.speedup_vs_ar", "ar.lossless"} & set(headline)
    assert headline["dflash.tau"] == 3.4


def test_generation_rows_are_one_per_prompt_and_method(tmp_path: Path) -> None:
    path = tmp_path / "generations.jsonl"
    ar = {"text": "a", "tau": 1.0, "rounds": 3, "matches_ar": True}
    same = {"text": "a", "tau": 2.0, "rounds": 2, "matches_ar": True}
    differs = {"text": "c", "tau": 1.5, "rounds": 1, "matches_ar": False, "divergence": {"position": 0}}
    rows = [
        {"id": "p1", "prompt": "hi", "methods": {"ar": ar, "dflash": same}},
        {"id": "p2", "prompt": "yo", "methods": {"ar": ar, "dflash": differs}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = generation_rows(path)
    assert columns["prompt_id"] == ["p1", "p1", "p2", "p2"]
    assert columns["method"] == ["ar", "dflash", "ar", "dflash"]
    assert columns["matches_ar"][-1] == "False" and json.loads(columns["divergence"][-1]) == {"position": 0}


def test_run_names_say_what_matters_first() -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = validate(compose(config_name="config", overrides=["decode.block_size=8"]))
        probe = validate(compose(config_name="config", overrides=["experiment=probe"]))
    assert re.fullmatch(r"\d\d-\d\d \d\d:\d\d · tiny_trained T=0 bs=8", run_name(config))  # its time tells it apart
    swept = run_name(config, {"decode.block_size": "8", "decode.max_new_tokens": "64"})
    assert swept.startswith("bs=8 max_new_tokens=64 · tiny_trained T=0 · ")  # a sweep's job: what varies first
    assert run_name(config, {"model": "tiny_trained"}).startswith("tiny_trained · T=0 bs=8 · ")
    # The default grid's jobs: told apart within the first 16 characters MLflow's runs table shows of a name.
    grid = {"model": "tiny_trained", "decode.temperature": "0", "decode.block_size": "8"}
    assert run_name(config, grid).startswith("T=0 bs=8 tiny_trained · ")
    assert run_name(probe).endswith(" · tiny_trained probe")


def test_the_tables_cells_are_padded_and_short_ones_never_wrap_when_rendered() -> None:
    """MLflow's description renders a table with no padding and wraps a cell where it may (`ddtree_tb164.00`,
    intervals cut at their dash): rendered as MLflow renders Markdown, every cell has a no-break space at each
    end, and a figure or a name has no place left to wrap."""
    html = MarkdownIt("commonmark").enable("table").render(summarize(SUMMARY, "t").markdown)
    cells = re.findall(r"<td>(.*?)</td>", html)
    assert cells and all(c == "" or (c.startswith("\u00a0") and c.endswith("\u00a0")) for c in cells), cells
    short = [c for c in cells if 0 < len(c) <= 26]
    assert all(" " not in c and re.search(r"[^\u2060][–-]|[–-][^\u2060]", c) is None for c in short), short
    assert "\u00a0240.0\u2060–\u2060260.0\u00a0" in cells and "\u00a0ddtree_tb32\u00a0" in cells


def test_every_method_run_has_a_description_of_its_own_figures() -> None:
    from orchestrator.tracking.job_summary import method_note

    tree = {"scope": "ddtree_tb16", "method": "ddtree", "tau": 4.0, "tau_ci_low": 2.99, "tau_ci_high": 5.45,
            "speedup_vs_ar": 2.02, "speedup_vs_ar_ci_low": 1.58, "speedup_vs_ar_ci_high": 2.72,
            "tokens_per_s": 901.04, "lossless": 1.0}  # fmt: skip
    assert method_note(tree, "tiny_trained · float32 · T=0 · local") == (
        "**ddtree_tb16** · tiny_trained · float32 · T=0 · local: tau 4.00 (2.99–5.45), ×2.02 (1.58–2.72) vs AR, "
        "901.0 tok/s, lossless 1.00. Its job's page compares it with the other methods."
    )
    ar = {"scope": "ar", "method": "ar", "tau": 1.0, "speedup_vs_ar": 1.0, "tokens_per_s": 445.1, "lossless": 1.0}
    assert method_note(ar, "t") == "**ar** · t: 445.1 tok/s. Its job's page compares it with the other methods."


def test_the_generations_table_rounds_tau_and_shows_a_whitespace_output(tmp_path: Path) -> None:
    path = tmp_path / "generations.jsonl"
    methods = {"ar": {"text": "\n\n  ", "tau": 1.0, "rounds": 3}, "dflash": {"text": "ok", "tau": 3.3333, "rounds": 1}}
    row = {"id": "p", "prompt": "x", "methods": methods}
    path.write_text(json.dumps(row) + "\n")
    columns = generation_rows(path)
    assert columns["output"] == ["'\\n\\n  '", "ok"] and columns["tau"] == [1.0, 3.33]
