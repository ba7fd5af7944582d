"""What the job's page says: the summary table, the generations table, the run's name."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import CONF_DIR
from orchestrator.config.validation import validate
from orchestrator.tracking.job_summary import generation_rows, summarize
from orchestrator.tracking.runs import run_name
from remote_worker.experiments.ddtree_gdn import best_basis, headline_metrics

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
    "best": {"scope": "ddtree_tb32", "basis": "one pass per prompt: no spread to tell noise from a difference"},
}  # fmt: skip


def test_the_table_has_a_row_per_method_in_order_and_names_the_best() -> None:
    rendered = summarize(SUMMARY, "tiny_trained · float32 · T=0 · local")
    rows = [line for line in rendered.markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["method", "ar", "dflash", "ddtree_tb32"]
    assert "| ddtree_tb32 | 4.50 | 250.0 | 240.0–260.0 | ×2.50 |" in rendered.markdown
    assert "1 / 0" in rendered.markdown  # near tie / unexplained
    assert (
        "Best: **ddtree_tb32**, ×2.50 vs AR at tau 4.50 (one pass per prompt: no spread to tell noise from a "
        "difference)." in rendered.markdown
    )
    table = list(csv.DictReader(io.StringIO(rendered.csv)))
    assert [r["method"] for r in table] == ["ar", "dflash", "ddtree_tb32"] and table[2]["tree_budget"] == "32"


def test_the_description_answers_first_then_a_table_markdown_reads_as_columns() -> None:
    lines = summarize(SUMMARY, "tiny_trained · float32 · T=0 · local").markdown.splitlines()
    assert (
        lines[0] == "**DDTree-32**: tau 4.50, ×2.50 vs AR, lossless 0.50 · **DFlash**: tau 3.40, ×2.20 vs AR, lossless"
    )
    table = [line for line in lines if line.startswith("|")]
    assert table[1] == "|" + " --- |" * (table[0].count("|") - 1)  # one separator cell per column
    assert lines[lines.index(table[0]) - 1] == ""  # a blank line before the table, or it is read as text


def test_the_range_is_at_the_medians_precision_and_holds_it() -> None:
    method = {"scope": "ar", "tokens_per_s": 8.6, "tokens_per_s_min": 8.55, "tokens_per_s_max": 9.2}
    row = next(line for line in summarize({"methods": [method]}, "t").markdown.splitlines() if line.startswith("| ar"))
    assert row == "| ar | 8.6 | 8.5–9.2 |"


def test_the_best_says_how_sure_it_is() -> None:
    def method(speedup: float, low: float, high: float, repeats: int = 3) -> dict[str, float]:
        return {"speedup_vs_ar": speedup, "speedup_vs_ar_min": low, "speedup_vs_ar_max": high, "repeats": repeats}

    ar = method(1.0, 1.0, 1.0)
    clear = {"ar": ar, "dflash": method(1.5, 1.4, 1.6), "ddtree_tb32": method(2.0, 1.8, 2.2)}
    assert best_basis(clear, "ddtree_tb32") == "ahead of every other method in all 3 passes"
    close = {"ar": ar, "dflash": method(1.9, 1.7, 2.1), "ddtree_tb32": method(2.0, 1.8, 2.2)}
    assert best_basis(close, "ddtree_tb32") == "not clearly ahead: its range over 3 passes overlaps another method's"
    once = {"ar": ar, "dflash": method(0.47, 0.47, 0.47, 1)}
    assert best_basis(once, "dflash") == (
        "slower than AR; one pass per prompt: no spread to tell noise from a difference"
    )


def test_at_temperature_above_zero_the_exactness_columns_are_left_out() -> None:
    hot = {"methods": [{k: v for k, v in m.items() if "lossless" not in k and "divergences" not in k}
                       for m in SUMMARY["methods"]]}  # fmt: skip
    assert "lossless" not in summarize(hot, "t").markdown


def test_headline_metrics_name_the_best_drafting_method() -> None:
    summary = {m["scope"]: {k: v for k, v in m.items() if isinstance(v, float)} for m in SUMMARY["methods"]}
    headline, best = headline_metrics(summary)
    assert best == "ddtree_tb32"
    assert headline["best.speedup_vs_ar"] == 2.5 and headline["ar.tokens_per_s"] == 100.0
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
    assert run_name(config).startswith("tiny_trained T=0 bs=8 · ")
    swept = run_name(config, {"decode.block_size": "8", "decode.max_new_tokens": "64"})
    assert swept.startswith("bs=8 max_new_tokens=64 · tiny_trained T=0 · ")  # a sweep's job: what varies first
    assert run_name(config, {"model": "tiny_trained"}).startswith("tiny_trained · T=0 bs=8 · ")
    assert run_name(probe).startswith("tiny_trained probe · ")
