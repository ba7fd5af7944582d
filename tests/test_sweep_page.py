"""What a researcher reads about a sweep: the parent run's page in MLflow, the plot's drawn lines, the terminal
table at 80 columns. In process, on the fake tracking store; `test_sweep.py` runs real multiruns."""

from __future__ import annotations

import csv
import io
import re

import pytest
from mlflow.entities import Metric, Param
from omegaconf import OmegaConf
from rich.console import Console

from orchestrator.sweep.callback import _as_settings, _grid, sweep_name
from orchestrator.sweep.page import job_metrics
from orchestrator.sweep.plot import draw_sweep
from orchestrator.sweep.rows import sweep_rows
from orchestrator.sweep.summary import summarize_sweep
from orchestrator.tracking import tags
from orchestrator.tracking.markdown_table import plain_markdown
from tests.fakes import FakeTracking

SWEPT = ["decode.block_size", "decode.temperature", "decode.max_new_tokens"]
# (job, block size, ddtree_tb4's and ddtree_tb8's speedups): job 1 holds the sweep's fastest method.
JOBS = ((0, 4, 1.4, 1.6), (1, 8, 1.9, 2.3), (2, 16, 0.9, 1.1))


def _fake_sweep(repeats: int = 1, intervals: bool = False) -> tuple[FakeTracking, str, str]:
    """A finished sweep as the jobs leave it in MLflow: a parent, a run per job, a run per method; with
    `intervals`, as runs of several prompts leave them: the drafting methods' 95 % intervals over prompts
    (tau ± 0.3, speedup ± 0.1) and DDTree's speedup over DFlash."""
    client = FakeTracking()
    experiment = client.create_experiment("ddtree_gdn")
    parent = client.create_run(experiment, "sweep", {tags.ROLE: "sweep"}).info.run_id
    for job, block, tb4, tb8 in JOBS:
        overrides = f"model=tiny_trained decode.block_size={block} decode.temperature=0 decode.max_new_tokens=64"
        job_run = client.create_run(
            experiment,
            f"job {job}",
            {tags.PARENT_RUN_ID: parent, tags.SWEEP_JOB: str(job), tags.MODEL: "tiny_trained",
             tags.HYDRA_OVERRIDES: overrides},
        ).info.run_id  # fmt: skip
        client.set_terminated(job_run, "FINISHED")
        methods = (("ar", "ar", 0, 1.0, 1.0), ("dflash", "dflash", 0, 2.5 + job, 1.2 + job / 10))
        methods += (("ddtree_tb4", "ddtree", 4, 3.0 + job, tb4), ("ddtree_tb8", "ddtree", 8, 3.5 + job, tb8))
        for scope, kind, budget, tau, speedup in methods:
            run = client.create_run(experiment, scope, {tags.PARENT_RUN_ID: job_run, tags.SCOPE: scope}).info.run_id
            params = {"method": kind, "tree_budget": str(budget), "repeats": str(repeats)}
            values = {"tau": tau, "speedup_vs_ar": speedup, "tokens_per_s": 100 * speedup, "lossless": 1.0}
            if intervals and kind != "ar":
                values.update(tau_ci_low=tau - 0.3, tau_ci_high=tau + 0.3)
                values.update(speedup_vs_ar_ci_low=speedup - 0.1, speedup_vs_ar_ci_high=speedup + 0.1)
            if intervals and kind == "ddtree":
                ratio = speedup / (1.2 + job / 10)
                values.update(speedup_vs_dflash=ratio, speedup_vs_dflash_ci_low=ratio - 0.05)
                values.update(speedup_vs_dflash_ci_high=ratio + 0.05)
            client.log_batch(
                run,
                metrics=[Metric(k, v, 0, 0) for k, v in values.items()],
                params=[Param(k, v) for k, v in params.items()],
            )
            client.set_terminated(run, "FINISHED")
    return client, experiment, parent


def test_the_sweep_plot_draws_each_jobs_dflash_dashed_and_ar_dotted_on_both_panels() -> None:
    client, _, parent = _fake_sweep()
    rows = sweep_rows(client, parent)
    assert {row.tree_budget for row in rows if row.kind != "ddtree"} == {None}  # AR and DFlash log budget 0
    fig = draw_sweep(rows)
    assert fig is not None
    tau_axis, speedup_axis = fig.axes[:2]
    for axis, key in ((tau_axis, "tau"), (speedup_axis, "speedup_vs_ar")):
        solid = [line for line in axis.get_lines() if line.get_linestyle() == "-"]
        dashed = [line for line in axis.get_lines() if line.get_linestyle() == "--"]
        dotted = [line for line in axis.get_lines() if line.get_linestyle() == ":"]
        assert len(solid) == len(JOBS)
        for line in solid:  # DDTree at its budgets only: never a point at budget 0 (AR, DFlash)
            assert list(line.get_xdata()) == [4, 8]
        expected = {job: next(r for r in rows if r.job == job and r.kind == "dflash") for job, *_ in JOBS}
        assert sorted(line.get_ydata()[0] for line in dashed) == sorted(getattr(r, key) for r in expected.values())
        for line in dashed:  # each job's DFlash in its own job's colour
            twin = [s for s in solid if s.get_color() == line.get_color()]
            assert len(twin) == 1
        assert [list(line.get_ydata()) for line in dotted] == [[1.0, 1.0]]  # AR: tau 1, speedup 1
        assert "dashed: DFlash; dotted: AR" in axis.get_title()


def test_the_parent_run_has_a_description_params_and_each_jobs_headline_metrics() -> None:
    client, experiment, parent = _fake_sweep()
    console = Console(width=80, record=True, color_system=None)
    status = summarize_sweep(client, experiment, parent, console, {0: "", 1: "", 2: ""}, SWEPT)
    assert status == "FINISHED"
    run = client.runs[parent]
    note = plain_markdown(run.tags[tags.NOTE]).splitlines()
    assert note[0] == "**Sweep FINISHED: 3 of 3 jobs finished** · varies block_size"
    assert note[2] == (  # no intervals (runs of under 5 prompts): nothing crowned, the runner-up named
        "No clear fastest: job #1 (block_size=8) ddtree_tb8: tau 4.50, ×2.30 vs AR, lossless · no 95 % intervals "
        "(fewer than 5 prompts) to tell it from the runner-up, job #1 (block_size=8) ddtree_tb4 ×1.90 · one pass "
        "per prompt"
    )
    header = note[4]
    assert header == "| job | status | block_size | method | tau | ×AR | tok/s | lossless |"
    assert note[5].count("---") == header.count("|") - 1  # a separator MLflow's Markdown reads as a table
    table = note[6:]
    assert len(table) == len(JOBS) * 4  # one row per job × method
    assert table[0] == "| 0 | FINISHED | 4 | ar | 1.00 | ×1.00 | 100.0 | 1.00 |"
    assert "decode." not in "\n".join(table)  # short columns, not a repeated overrides string
    assert run.params == {"grid.decode.block_size": "4,8,16", "grid.decode.temperature": "0",
                          "grid.decode.max_new_tokens": "64"}  # fmt: skip
    metrics = run.as_mlflow().data.metrics
    order = list(job_metrics(sweep_rows(client, parent)))  # as logged: MLflow's run page lists them so
    assert order[0] == "job0.ar.tokens_per_s"  # no best.* where nothing is crowned
    assert not [key for key in order if re.search(r"\.ar\.(tau|speedup_vs_ar|lossless)$", key)]  # 1 by definition
    assert metrics["job1.ddtree_tb8.speedup_vs_ar"] == 2.3
    assert metrics["job2.dflash.tau"] == 4.5
    assert "best.speedup_vs_ar" not in metrics
    assert tags.SWEEP_BEST_JOB not in run.tags and tags.BEST_METHOD not in run.tags
    assert run.status == "FINISHED"
    text = console.export_text()
    assert (
        f"sweep run: http://fake-mlflow:5000/#/experiments/{experiment}/runs/{parent}?workflowType=machine_learning"
        in text.splitlines()
    )


def test_with_repeats_the_fastest_says_how_many_passes_and_a_slowdown_says_so() -> None:
    client, experiment, parent = _fake_sweep(repeats=3)
    for run in client.runs.values():  # every drafting method slower than AR
        run.metrics = {(k, t, s, v / 4 if k == "speedup_vs_ar" else v) for k, t, s, v in run.metrics}
    summarize_sweep(client, experiment, parent, Console(width=80, record=True), {0: "", 1: "", 2: ""}, SWEPT)
    line = plain_markdown(client.runs[parent].tags[tags.NOTE]).splitlines()[2]
    assert "ddtree_tb8: tau 4.50, ×0.57 vs AR, lossless (slower than AR) · " in line, line
    assert line.endswith(" · median of 3 passes"), line


def test_the_intervals_over_prompts_are_columns_of_the_description_the_csv_and_metrics() -> None:
    client, experiment, parent = _fake_sweep(intervals=True)
    console = Console(width=80, record=True, color_system=None)
    summarize_sweep(client, experiment, parent, console, {0: "", 1: "", 2: ""}, SWEPT)
    run = client.runs[parent]
    note = plain_markdown(run.tags[tags.NOTE]).splitlines()
    assert note[2] == (
        "Fastest: job #1 (block_size=8) ddtree_tb8: tau 4.50, ×2.30 (2.20–2.40) vs AR, lossless · its interval "
        "clears the runner-up's, job #1 (block_size=8) ddtree_tb4 ×1.90 (1.80–2.00) · one pass per prompt"
    )
    metrics = run.as_mlflow().data.metrics
    assert metrics["best.speedup_vs_ar"] == 2.3
    assert run.tags[tags.SWEEP_BEST_JOB] == "1" and run.tags[tags.BEST_METHOD] == "ddtree_tb8"
    assert note[4] == (
        "| job | status | block_size | method | tau | tau 95% CI | ×AR | ×AR 95% CI | vs DFlash | tok/s | lossless |"
    )
    assert note[5].count("---") == note[4].count("|") - 1
    assert note[6] == "| 0 | FINISHED | 4 | ar | 1.00 |  | ×1.00 |  |  | 100.0 | 1.00 |"  # AR: 1 by definition
    assert note[7] == "| 0 | FINISHED | 4 | dflash | 2.50 | 2.20–2.80 | ×1.20 | ×1.10–1.30 |  | 120.0 | 1.00 |"
    fastest = "| 1 | FINISHED | 8 | ddtree_tb8 | 4.50 | 4.20–4.80 | ×2.30 | ×2.20–2.40 | ×1.77 (1.72–1.82) |"
    assert note[13] == fastest + " 230.0 | 1.00 |"
    table = list(csv.DictReader(io.StringIO(run.artifacts["sweep_summary.csv"].decode())))
    ddtree = next(r for r in table if r["job"] == "1" and r["method"] == "ddtree_tb8")
    assert float(ddtree["tau_ci_low"]) == pytest.approx(4.2)
    assert float(ddtree["speedup_vs_dflash_ci_high"]) == pytest.approx(2.3 / 1.3 + 0.05)
    assert next(r for r in table if r["method"] == "ar")["speedup_vs_ar_ci_low"] == ""
    metrics = run.as_mlflow().data.metrics
    assert metrics["job1.ddtree_tb8.speedup_vs_ar_ci_high"] == pytest.approx(2.4)
    assert metrics["job2.ddtree_tb4.speedup_vs_dflash"] == pytest.approx(0.9 / 1.4)
    assert "job0.ar.tau_ci_low" not in metrics
    header = next(line for line in console.export_text().splitlines() if "method" in line)
    assert "CI" not in header and "DFlash" not in header  # the terminal's table keeps to 80 columns


def test_one_prompt_runs_show_ddtree_over_dflash_without_interval_columns() -> None:
    client, experiment, parent = _fake_sweep(intervals=True)
    for run in client.runs.values():  # one prompt: no intervals, DDTree's ratio to DFlash all the same
        run.metrics = {m for m in run.metrics if "_ci_" not in m[0]}
    summarize_sweep(client, experiment, parent, Console(width=80, record=True), {0: "", 1: "", 2: ""}, SWEPT)
    note = plain_markdown(client.runs[parent].tags[tags.NOTE]).splitlines()
    assert note[4] == "| job | status | block_size | method | tau | ×AR | vs DFlash | tok/s | lossless |"
    assert note[13] == "| 1 | FINISHED | 8 | ddtree_tb8 | 4.50 | ×2.30 | ×1.77 | 230.0 | 1.00 |"


@pytest.mark.parametrize("width", [80, 120])
def test_the_terminal_summary_fits_its_width_one_line_per_method(width: int) -> None:
    client, experiment, parent = _fake_sweep()
    for run in client.runs.values():  # a sweep varying three keys, values as long as real ones
        over = run.tags.get(tags.HYDRA_OVERRIDES)
        if over:
            job = run.tags[tags.SWEEP_JOB]
            run.tags[tags.HYDRA_OVERRIDES] = over.replace("temperature=0", f"temperature=0.{job}").replace(
                "max_new_tokens=64", f"max_new_tokens={64 * (int(job) + 1)}"
            )
    console = Console(width=width, record=True, color_system=None)
    summarize_sweep(client, experiment, parent, console, {0: "", 1: "", 2: ""}, SWEPT)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines if not line.startswith("sweep run: ")) <= width  # a URL is not folded
    header = next(line for line in lines if "method" in line)
    assert re.split(r"\s+", header.strip()) == [
        "job",
        "bs",
        "T",
        "max_new_tokens",
        "method",
        "tau",
        "×AR",
        "tok/s",
        "lossless",
    ]  # fmt: skip: every job finished, so no status column (the title says FINISHED)
    verdict = next(i for i, line in enumerate(lines) if line.startswith(("Fastest", "No clear fastest")))
    rows = [line for line in lines[:verdict] if re.search(r"\b(ar|dflash|ddtree_tb\d+)\b", line)]
    assert len(rows) == len(JOBS) * 4  # each method one whole line; a job's settings on its first
    assert re.split(r"\s+", rows[4].strip()) == ["1", "8", "0.1", "128", "ar", "1.00", "×1.00", "100.0", "1.00"]


def test_names_lead_with_what_varies() -> None:
    assert sweep_name(["decode.block_size", "decode.temperature"], 6).startswith(
        "sweep of block_size × temperature · 6 jobs"
    )


def test_a_grid_axis_the_command_line_fixes_is_not_swept() -> None:
    """`make sweep ARGS=model=tiny_trained`: the grid's model axis is replaced, so the sweep varies only the rest
    (its name, its jobs' names and its grid params leave the model out) and has half the jobs."""
    hydra = {
        "sweeper": {"params": {"model": "tiny_trained,tiny_trained_dense", "decode.temperature": "0,1"}},
        "overrides": {"task": ["model=tiny_trained", "decode.block_size=4,8"]},
        "runtime": {"choices": {"hydra/sweeper": "basic"}},
    }
    jobs, swept, overrides = _grid(OmegaConf.create({"hydra": hydra}))
    grid = [_as_settings(job) for job in overrides]
    assert (jobs, swept) == (4, ["decode.temperature", "decode.block_size"])
    # each job's own overrides, in launch order (the plan reads each job's prompt set from them)
    assert [(job["model"], job["decode.temperature"], job["decode.block_size"]) for job in grid] == [
        ("tiny_trained", t, b) for t in ("0", "1") for b in ("4", "8")
    ]
    assert sweep_name(swept, jobs).startswith("sweep of temperature × block_size · 4 jobs · ")


def test_the_default_grids_table_at_80_columns_cuts_no_figure_and_no_name() -> None:
    """`make sweep`'s grid (two models × two temperatures × two block sizes, budgets 8 and 32): every method
    name and every figure whole at 80 columns, the speedup first of all (it is the sweep's answer)."""
    client = FakeTracking()
    experiment = client.create_experiment("ddtree_gdn")
    parent = client.create_run(experiment, "sweep", {tags.ROLE: "sweep"}).info.run_id
    grid = [(m, t, b) for m in ("tiny_trained", "tiny_trained_dense") for t in ("0", "1") for b in ("4", "8")]
    for job, (model, temperature, block) in enumerate(grid):
        overrides = f"model={model} decode.temperature={temperature} decode.block_size={block}"
        job_tags = {tags.PARENT_RUN_ID: parent, tags.SWEEP_JOB: str(job), tags.MODEL: model,
                    tags.HYDRA_OVERRIDES: overrides}  # fmt: skip
        job_run = client.create_run(experiment, f"job {job}", job_tags).info.run_id
        client.set_terminated(job_run, "FINISHED")
        for scope, kind, budget in (("ar", "ar", 0), ("dflash", "dflash", 0), ("ddtree_tb8", "ddtree", 8),
                                    ("ddtree_tb32", "ddtree", 32)):  # fmt: skip
            run = client.create_run(experiment, scope, {tags.PARENT_RUN_ID: job_run, tags.SCOPE: scope}).info.run_id
            values = {"tau": 3.14159, "speedup_vs_ar": 12.3456, "tokens_per_s": 1234.5}
            if temperature == "0":
                values["lossless"] = 1.0
            client.log_batch(run, metrics=[Metric(k, v, 0, 0) for k, v in values.items()],
                             params=[Param("method", kind), Param("tree_budget", str(budget))])  # fmt: skip
            client.set_terminated(run, "FINISHED")
    console = Console(width=80, record=True, color_system=None)
    summarize_sweep(client, experiment, parent, console, dict.fromkeys(range(len(grid)), ""),
                    ["model", "decode.temperature", "decode.block_size"])  # fmt: skip
    lines = console.export_text().splitlines()
    table = [line for line in lines if not line.startswith(("sweep run: ", "Fastest"))]
    assert max(len(line) for line in table) <= 80 and not any("…" in line for line in table), "\n".join(table)
    header = next(line for line in lines if "method" in line)
    assert re.split(r"\s+", header.strip()) == ["job", "model", "T", "bs", "method", "tau", "×AR", "tok/s", "lossless"]
    verdict = next(i for i, line in enumerate(lines) if line.startswith(("Fastest", "No clear fastest")))
    rows = [line for line in lines[:verdict] if re.search(r"\b(ar|dflash|ddtree_tb\d+)\b", line)]
    assert len(rows) == len(grid) * 4 and all(re.search(r" ×12\.35 +1234\.5\b", row) for row in rows), rows
    assert sum("ddtree_tb32" in row for row in rows) == len(grid)
