"""The paper's table: its figures computed the paper's way from records, shards merged, the best budget, the
page's Markdown and CSV, and the paper's own figures shipped as data."""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

import pytest

from orchestrator.sweep.paper.figures import (
    MethodRecord,
    Record,
    RecordsDisagree,
    best_ddtree,
    cell,
    merge,
    read_records,
)
from orchestrator.sweep.paper.table import (
    DATASETS,
    JobRecords,
    Missing,
    entries,
    load_job,
    markdown,
    paper_figures,
    terminal_lines,
    write_csv,
)
from orchestrator.sweep.summary import CUT_NOTE, fitted
from orchestrator.tracking.markdown_table import plain_markdown


def record(rid: str, ar: tuple[float, int], **methods: tuple[float, int, float]) -> Record:
    """`ar`: (decode seconds, tokens); each method: (decode seconds, tokens, tau)."""
    found = {"ar": MethodRecord(tuple(range(ar[1])), ar[0], 1.0)}
    found.update({scope: MethodRecord(tuple(range(n)), s, tau) for scope, (s, n, tau) in methods.items()})
    return Record(rid, found)


def test_speedup_is_a_ratio_of_mean_times_per_token_and_tau_a_mean_of_record_taus() -> None:
    records = [
        record("d-0", (4.0, 8), dflash=(1.0, 8, 4.0)),  # AR 0.5 s/token, DFlash 0.125
        record("d-1", (3.0, 2), dflash=(0.5, 1, 1.0)),  # AR 1.5 s/token, DFlash 0.5
    ]
    c = cell(records, "dflash")
    assert c.speedup == pytest.approx(((0.5 + 1.5) / 2) / ((0.125 + 0.5) / 2))  # not the mean of ratios (3.5)
    assert c.tau == pytest.approx(2.5)  # each record weighs the same, whatever its rounds
    assert c.speedup_ci is None and c.tau_ci is None  # fewer than 5 records: no interval


def test_intervals_over_five_records_hold_the_figure() -> None:
    records = [record(f"d-{i}", (1.0 + i, 10), dflash=(0.3 + 0.1 * i, 10, 3.0 + i)) for i in range(6)]
    c = cell(records, "dflash")
    assert c.speedup_ci is not None and c.tau_ci is not None
    assert c.speedup_ci.low <= c.speedup <= c.speedup_ci.high
    assert c.tau_ci.low <= c.tau == statistics.fmean(3.0 + i for i in range(6)) <= c.tau_ci.high


def test_the_ddtree_cell_is_the_fastest_decoded_budget() -> None:
    records = [
        record("d-0", (10.0, 10), ddtree_tb16=(2.0, 10, 5.0), ddtree_tb64=(1.0, 10, 7.0), ddtree_tb1024=(1.5, 10, 9.0))
    ]
    best = best_ddtree(records)
    assert best is not None and best.budget == 64 and best.speedup == pytest.approx(10.0)
    tie = [record("d-0", (10.0, 10), ddtree_tb16=(1.0, 10, 5.0), ddtree_tb64=(1.0, 10, 7.0))]
    assert best_ddtree(tie).budget == 16  # a tie goes to the smaller tree
    assert best_ddtree([record("d-0", (1.0, 1), dflash=(1.0, 1, 1.0))]) is None


def test_shards_merge_into_the_whole_sets_records_and_disagreeing_tokens_are_refused() -> None:
    whole = [record(f"s-{i}", (1.0, 4), dflash=(0.5, 4, 2.0)) for i in range(11)]
    merged = merge([whole[1::2], whole[0::2]])
    assert [r.id for r in merged] == [f"s-{i}" for i in range(11)]  # s-10 after s-9
    assert cell(merged, "dflash") == cell(whole, "dflash")
    assert merge([whole, whole[:3]]) == whole  # a record decoded twice alike counts once
    other = record("s-0", (1.0, 5), dflash=(0.5, 4, 2.0))
    with pytest.raises(RecordsDisagree, match="s-0"):
        merge([whole, [other]])


def test_records_are_read_from_generations_rows(tmp_path: Path) -> None:
    rows = [
        {"id": "mt-bench-0", "turn": 1, "methods": {"ar": {"tokens": [1, 2], "decode_s": 0.2, "tau": 1.0},
                                                    "dflash": {"tokens": [1, 2], "decode_s": 0.1, "tau": 2.0}}},
        {"id": "mt-bench-0#2", "turn": 2, "methods": {"ar": {"tokens": [3], "decode_s": 0.1, "tau": 1.0},
                                                      "dflash": {"tokens": [3], "decode_s": 0.1, "tau": 1.0}}},
    ]  # fmt: skip
    records = read_records(json.dumps(r) + "\n" for r in rows)
    assert [r.id for r in records] == ["mt-bench-0", "mt-bench-0#2"]
    assert records[0].methods["dflash"].seconds_per_token == pytest.approx(0.05)


def test_the_page_and_csv_put_the_papers_figures_beside_ours(tmp_path: Path) -> None:
    def job(dataset: str, t: float, scale: float) -> JobRecords:
        records = [
            record(f"{dataset}-{i}", (8.0, 8), dflash=(2.0 * scale, 8, 4.0), ddtree_tb64=(1.0 * scale, 8, 7.0 + i))
            for i in range(5)
        ]
        return JobRecords(dataset, t, "qwen3_8b", records)

    found = entries([job("math500", 1.0, 1.0), job("gsm8k", 0.0, 2.0), job("math500", 0.0, 1.0)])
    assert [(e.dataset, e.temperature) for e in found] == [("gsm8k", 0.0), ("math500", 0.0), ("math500", 1.0)]
    raw = markdown(found, "qwen3_8b")
    # MLflow's narrow description column wraps a cell between figures, never inside one (no-break spaces)
    assert "τ\u00a04.00\u00a0(4.00\u2060–\u20604.00)" in raw and "_paper\u00a0×5.56\u00a0· τ\u00a07.79_" in raw
    assert not re.search(r"[τ×] \d|\d \(|paper ×|\d–|–\d| ·", raw.split("\n\n")[1]), raw
    page = plain_markdown(raw)
    lines = page.splitlines()
    assert lines[2] == "| dataset | T=0 DFlash | T=0 DDTree | T=1 DFlash | T=1 DDTree | best budget |"
    math_row = next(line for line in lines if line.startswith("| math500 |"))
    # ours, then the paper's in italics (Qwen3-8B, MATH-500, T=0)
    assert "×4.00 (4.00–4.00) · τ 4.00 (4.00–4.00) · _paper ×5.56 · τ 7.79_" in math_row
    assert "×8.00 (8.00–8.00) · τ 9.00 (" in math_row and "_paper ×7.52 · τ 10.73_" in math_row
    assert math_row.endswith("| 64 / 64 |")
    assert "| gsm8k |" in page and "| **mean of 2/1 datasets** |" in page and "src/data/results.tex" in page
    raw = markdown(found, "qwen3_8b")
    assert "| &nbsp;dataset&nbsp; |" in raw  # MLflow's description pads no cell: we do
    write_csv(found, "qwen3_8b", tmp_path / "t.csv")
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert rows[0]["dataset"] == "gsm8k" and rows[0]["method"] == "dflash" and rows[0]["paper_speedup"] == "4.78"
    assert "paper" not in markdown(found, "qwen3_6_27b").split("\n\n")[1]  # no paper column for a model it lacks


def test_the_papers_own_figures_are_every_cell_of_its_table() -> None:
    figures = paper_figures()
    models = {"Qwen3-4B", "Qwen3-8B", "Qwen3-Coder-30B-A3B-Instruct"}
    assert set(figures) == {
        (m, d, t, k) for m in models for d in DATASETS for t in (0.0, 1.0) for k in ("dflash", "ddtree")
    }
    assert all(figures[(m, d, t, "ddtree")].speedup > figures[(m, d, t, "dflash")].speedup for m, d, t, _ in figures)
    assert figures[("Qwen3-8B", "math500", 0.0, "ddtree")].tau == 10.73
    assert figures[("Qwen3-Coder-30B-A3B-Instruct", "alpaca", 1.0, "dflash")].speedup == 1.51


def test_a_page_longer_than_a_description_may_be_is_cut_at_a_line_and_says_where_the_rest_is() -> None:
    page = "".join(f"| row {i} | {'x' * 90} |\n" for i in range(200))
    cut = fitted(page, 8000)
    assert len(cut) <= 8000 and cut.endswith(CUT_NOTE) and cut[: -len(CUT_NOTE)].endswith("|")
    assert fitted("short", 8000) == "short"


def test_the_terminal_table_fits_80_columns_and_keeps_a_failed_datasets_row() -> None:
    """The widest figures (×10.00, τ 16.00, budgets 1024/1024) at 80 columns; aime25 failed at both temperatures:
    its row says so, and the mean says it is over 9 datasets."""
    jobs = [
        JobRecords(d, t, "qwen3_6_27b", [record(f"{d}-{i}", (100.0, 16), dflash=(10.0, 16, 16.0),
                                                ddtree_tb1024=(10.0, 16, 16.0)) for i in range(5)])
        for d in DATASETS if d != "aime25" for t in (0.0, 1.0)
    ]  # fmt: skip
    missing = [Missing("aime25", t, "experiment.prompts: aime25: MathArena/aime_2025 is not in ~/d") for t in (0, 1)]
    lines = terminal_lines(entries(jobs), "qwen3_6_27b", missing)
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert lines[1].split() == ["T=0", "T=1"]
    assert lines[2].split() == ["dataset", "DFlash", "DDTree", "DFlash", "DDTree", "budget"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    assert list(rows)[:11] == [*DATASETS, "mean"]
    assert rows["gsm8k"] == ["×10.00", "τ16.00"] * 4 + ["1024/1024"]
    assert rows["aime25"] == ["FAILED"] * 4 + ["–/–"]
    assert lines[-1].startswith("mean (9 sets)")
    page = plain_markdown(markdown(entries(jobs), "qwen3_6_27b", missing))
    assert "| aime25 | FAILED: experiment.prompts: aime25: MathArena/aime_2025 is not in ~/d |" in page
    assert "| **mean of 9 datasets** |" in page


def test_a_decoded_budget_shows_its_measured_tau_beside_the_curves() -> None:
    """The curve said τ 1.00 at 64 where the decode at 64 measured τ 4.00: the row shows both and flags it."""
    records = [record(f"g-{i}", (8.0, 8), ddtree_tb64=(2.0, 8, 4.0), ddtree_tb1024=(2.0, 8, 4.0)) for i in range(5)]
    curve = {"budget_curve": {"tau": [1.0] * 1024}, "prediction": {}, "methods": [{"prompts": 5}]}
    found = entries([JobRecords("gsm8k", 0.0, "m", records, curve)])
    page = plain_markdown(markdown(found, "m"))
    row = next(line for line in page.splitlines() if line.startswith("| gsm8k | 0 |"))
    assert "τ 1.00 (decoded τ 4.00 ⚠)" in row and "⚠ 2 decoded budgets measured a tau outside" in page


def test_a_decode_shorter_than_a_draft_block_reports_no_curve_and_says_why(tmp_path: Path) -> None:
    """8 new tokens with blocks of 16: no round holds a whole tree, so the curve (τ 1.00 at 64 where 64 measured
    4.00) is left out with the reason; 32 new tokens keep it."""
    rows = [{"id": f"g-{i}", "methods": {"ar": {"tokens": [1] * 8, "decode_s": 0.8, "tau": 1.0},
                                         "ddtree_tb64": {"tokens": [1] * 8, "decode_s": 0.2, "tau": 4.0}}}
            for i in range(5)]  # fmt: skip
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"block_size": 16, "budget_curve": {"tau": [1.0] * 64}, "prediction": {}, "methods": []}
    (tmp_path / "s.json").write_text(json.dumps(summary))
    short = load_job(tmp_path / "g.jsonl", tmp_path / "s.json", "gsm8k", 0.0, "m", max_new_tokens=8)
    page = plain_markdown(markdown(entries([short]), "m"))
    assert "**Every budget**: not shown for the jobs whose decode.max_new_tokens=8 is shorter than a draft " in page
    assert "| gsm8k | 0 |" not in page
    long = load_job(tmp_path / "g.jsonl", tmp_path / "s.json", "gsm8k", 0.0, "m", max_new_tokens=32)
    assert "| gsm8k | 0 |" in plain_markdown(markdown(entries([long]), "m"))


def two_phase_record(i: int, sampled: bool) -> Record:
    """Record `i` of a two-phase job: a prompt of 100 + 10·i tokens, 8 output tokens; AR (10 ms a step +
    10 µs a context token) and DDTree at 1024 on the sample, DFlash and DDTree at 32 on every record."""
    prompt = 100 + 10 * i
    methods = {
        "dflash": MethodRecord(tuple(range(8)), 0.04, 3.0),
        "ddtree_tb32": MethodRecord(tuple(range(8)), 0.02, 5.0),
    }
    if sampled:
        ar_s = 8 * 0.01 + 1e-5 * (8 * prompt + 28)
        methods |= {
            "ar": MethodRecord(tuple(range(8)), ar_s, 1.0),
            "ddtree_tb1024": MethodRecord(tuple(range(8)), 0.05, 6.0),
        }
    return Record(f"gsm8k-{i}", methods, prompt)


def test_a_two_phase_dataset_shows_the_chosen_budget_ar_predicted_and_a_faster_predicted_budget_flagged() -> None:
    records = [two_phase_record(i, i % 4 == 0) for i in range(20)]
    taus = [4.0] * 1024
    speeds = [100.0] * 1024
    speeds[63] = 300.0  # budget 64 predicted ×6.00 (AR predicted at 50 tokens/s), the chosen 32 measured ×~4.4
    summary = {"protocol": {"kind": "two_phase", "chosen_budget": 32}, "budget_curve": {"tau": taus},
               "prediction": {"tokens_per_s": speeds, "ar_predicted_tokens_per_s": 50.0, "error_worst": 0.1},
               "methods": [{"prompts": 5}]}  # fmt: skip
    (entry,) = entries([JobRecords("gsm8k", 0.0, "m", records, summary)])
    assert entry.records == 20 and entry.two_phase is not None
    assert entry.two_phase.chosen == (32,) and (entry.two_phase.sample_records, entry.two_phase.predicted) == (5, 15)
    assert entry.two_phase.check is not None and entry.two_phase.check.worst < 1e-6  # the exact cost model
    assert entry.ddtree is not None and entry.ddtree.budget == 32 and entry.ddtree.records == 20
    # AR predicted on the 15 other records exactly: the speedup is the ratio of the whole set's sums
    ar_per_token = [(8 * 0.01 + 1e-5 * (8 * (100 + 10 * i) + 28)) / 8 for i in range(20)]
    assert entry.ddtree.speedup == pytest.approx(statistics.fmean(ar_per_token) / (0.02 / 8), rel=1e-6)
    assert entry.measured[1024].records == 5  # the largest budget, on the sample
    page = plain_markdown(markdown([entry], "m"))
    assert "| gsm8k | 0 | 32 | 5 | 15 | 0.0 % · +0.0 % |" in page and page.splitlines()[2].endswith("| budget |")
    assert (
        f"⚠ gsm8k T=0: the curve predicts 64 at ×6.00, faster than the chosen 32 measured "
        f"(×{entry.ddtree.speedup:.2f}) by more than the prediction's error (±10 %): the prediction that chose it "
        "missed"
    ) in page
    assert "DDTree at the budget chosen before it was measured (two phases)" in page
    assert "DDTree at its chosen budget" in terminal_lines([entry], "m")[0]


def test_ddtree_online_gets_a_column_beside_the_best_budget_and_its_ratio_to_it(tmp_path: Path) -> None:
    """A grid job that decoded `ddtree_online` (`decode.online_budget=true`): the page has a DDTree-online column
    per temperature, its speed over the best budget's on the same records with the 95 % interval (`vs best`);
    the CSV a row per cell; the terminal a line per temperature under its 80-column table. A job without it
    keeps the table as it was."""

    def job(dataset: str, t: float, online: float) -> JobRecords:
        records = [
            record(f"{dataset}-{i}", (8.0, 8), dflash=(2.0, 8, 4.0), ddtree_tb32=(1.0 + 0.01 * i, 8, 7.0),
                   ddtree_tb64=(1.5, 8, 8.0), ddtree_online=(online + 0.01 * i, 8, 7.5))
            for i in range(6)
        ]  # fmt: skip
        return JobRecords(dataset, t, "qwen3_6_27b", records)

    found = entries([job("gsm8k", 0.0, 1.25), job("mbpp", 0.0, 0.8), job("gsm8k", 1.0, 1.0)])
    gsm8k = found[0]
    assert gsm8k.online is not None and gsm8k.online.speedup == pytest.approx(8.0 / 1.275 * 6 / 6, rel=1e-9)
    assert gsm8k.online_vs_best is not None and gsm8k.ddtree is not None and gsm8k.ddtree.budget == 32
    # the best budget's time over online's, summed over the same records: 6.15 / 7.65
    assert gsm8k.online_vs_best.speedup == pytest.approx(6.15 / 7.65)
    assert gsm8k.online_vs_best.speedup_ci is not None and gsm8k.online_vs_best.speedup_ci.high < 1
    page = plain_markdown(markdown(found, "qwen3_6_27b")).splitlines()
    assert page[2] == ("| dataset | T=0 DFlash | T=0 DDTree | T=0 DDTree-online | T=1 DFlash | T=1 DDTree | "
                       "T=1 DDTree-online | best budget |")  # fmt: skip
    row = next(line for line in page if line.startswith("| gsm8k |"))
    assert f"· vs best ×{6.15 / 7.65:.2f} (" in row
    assert any(line.startswith("DDTree-online: DDTree with a budget per round") for line in page)
    write_csv(found, "qwen3_6_27b", tmp_path / "t.csv")
    methods = [r["method"] for r in csv.DictReader((tmp_path / "t.csv").open())]
    assert methods.count("ddtree_online") == 3
    lines = terminal_lines(found, "qwen3_6_27b")
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert lines[-2:] == [
        f"DDTree-online T=0: ×{statistics.fmean([6.15 / 7.65, 6.15 / 4.95]):.2f} of the best budget (2 sets: 1 "
        "ahead, 1 behind)",
        f"DDTree-online T=1: ×{6.15 / 6.15:.2f} of the best budget (1 set: 0 ahead, 0 behind)",
    ]
    plain = entries([JobRecords("gsm8k", 0.0, "qwen3_6_27b", [record("g-0", (8.0, 8), ddtree_tb32=(1.0, 8, 7.0))])])
    assert "DDTree-online" not in markdown(plain, "qwen3_6_27b") and plain[0].online is None
