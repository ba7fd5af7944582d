"""The summary a sweep's parent run gets when the multirun ends: a table of every job and method, plots.

Everything is read back from MLflow (the job runs under the parent, the method runs under each job), so
the summary is the same whichever launcher ran the jobs and wherever they ran.
"""

from __future__ import annotations

import csv
import tempfile
import time
from dataclasses import fields
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_TAG_VAL_LENGTH
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator.sweep.page import FIGURES, description, fastest, figure_cells, grid_params, job_metrics
from orchestrator.sweep.paper.page import paper_section
from orchestrator.sweep.plot import plot_sweep
from orchestrator.sweep.rows import REFUSED, Row, short_names, sweep_rows, varying_keys
from orchestrator.tracking import tags as mlflow_tags
from orchestrator.tracking.runs import run_url
from orchestrator.tracking.status import NOT_STARTED, STATUS_STYLE

CSV_FILE, MARKDOWN_FILE = "sweep_summary.csv", "sweep_summary.md"
MAX_METRICS_PER_BATCH = 900  # MLflow takes 1000 metrics, params and tags together in one log_batch


def write_csv(rows: list[Row], path: Path) -> None:
    names = [f.name for f in fields(Row)]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for row in rows:
            writer.writerow(["" if getattr(row, n) is None else getattr(row, n) for n in names])


CUT_NOTE = f"\n\n… cut at MLflow's limit for a description: the whole page is the artifact {MARKDOWN_FILE}.\n"


def fitted(page: str, limit: int = MAX_TAG_VAL_LENGTH) -> str:
    """The page as the parent's description: whole when it fits MLflow's limit on a tag, else cut at the last
    line that fits, saying where the whole page is (a paper sweep's table and its 80 job rows do not fit)."""
    if len(page) <= limit:
        return page
    return page[: page.rfind("\n", 0, limit - len(CUT_NOTE))] + CUT_NOTE


def sweep_status(rows: list[Row]) -> str:
    statuses = {row.status for row in rows if row.status != REFUSED}
    if "FAILED" in statuses:
        return "FAILED"
    if "KILLED" in statuses:
        return "KILLED"
    return "FINISHED"


def summarize_sweep(
    client: MlflowClient,
    experiment_id: str,
    parent_run_id: str,
    console: Console,
    job_dirs: dict[int, str],
    swept: list[str] | None = None,
    grid: list[dict[str, str]] | None = None,
    key: bytes | None = None,
) -> str:
    """Give the parent run its page (description, the grid as params, every job's headline metrics, the
    table as files, the plot), end it, print the table and its address; return the sweep's status.

    `job_dirs` maps every job Hydra launched to the error it recorded before it had a run (or ""): a job
    without a run is a FAILED row, never a silent gap. `swept` are the keys the sweep varies, `grid` each job's
    settings, `key` the user's signing key (a reused run counts only when its signature verifies). A sweep
    over the paper's datasets ends on the paper's table, the job table left to its page."""
    rows = sweep_rows(client, parent_run_id, key)
    with_runs = {row.job for row in rows if row.status != REFUSED}  # a refused claim never hides a job's failure
    for job, error in sorted(job_dirs.items()):
        if job not in with_runs:
            reason = error or "the job ended before it created its MLflow run"
            status = "KILLED" if reason.startswith(NOT_STARTED) else "FAILED"  # cancelled before it ran
            rows.append(Row(job=job, status=status, model="", overrides="", error=reason))
    rows.sort(key=lambda row: row.job)
    status = sweep_status(rows) if rows else "FAILED"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_csv(rows, folder / CSV_FILE)
        page = description(rows, status)
        paper = paper_section(client, rows, folder, grid)
        if paper is not None:  # the paper's table leads: it is the question a paper sweep asks
            page = paper.markdown + "\n" + page
            for path in paper.files:
                client.log_artifact(parent_run_id, str(path))
        (folder / MARKDOWN_FILE).write_text(page, encoding="utf-8")
        client.log_artifact(parent_run_id, str(folder / CSV_FILE))
        client.log_artifact(parent_run_id, str(folder / MARKDOWN_FILE))
        for figure in plot_sweep(rows, folder):
            client.log_artifact(parent_run_id, str(figure), artifact_path="plots")
    jobs = {row.job: row for row in rows if row.status != REFUSED}
    failed = [row for row in jobs.values() if row.status != "FINISHED"]
    refused = [row for row in rows if row.status == REFUSED]
    run_tags = [
        RunTag(mlflow_tags.NOTE, fitted(page)),
        RunTag(mlflow_tags.SWEEP_JOBS, str(len(jobs))),
        RunTag(mlflow_tags.SWEEP_NOT_FINISHED, str(len(failed))),
    ]
    best = fastest(rows)
    if best is not None and best.crowned:
        run_tags += [
            RunTag(mlflow_tags.BEST_METHOD, best.row.method),
            RunTag(mlflow_tags.SWEEP_BEST_JOB, str(best.row.job)),
        ]
    now = int(time.time() * 1000)
    metrics = [Metric(key, value, now, 0) for key, value in job_metrics(rows).items()]
    params = [Param(f"grid.{key}", values) for key, values in grid_params(rows, swept or []).items()]
    for start in range(0, max(len(metrics), 1), MAX_METRICS_PER_BATCH):  # tags and params ride the first
        first = start == 0
        client.log_batch(
            parent_run_id,
            metrics=metrics[start : start + MAX_METRICS_PER_BATCH],
            params=params if first else [],
            tags=run_tags if first else [],
        )
    client.set_terminated(parent_run_id, status)
    if paper is not None:  # the sweep's answer is the paper's table; the job table is on the page
        for line in paper.terminal:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        console.print(f"Sweep: [{STATUS_STYLE.get(status, 'white')}]{status}[/] · {len(jobs)} jobs; every job and "
                      f"method, the budget curve and the figure: the sweep's page ({MARKDOWN_FILE})")  # fmt: skip
    else:
        console.print(_table(rows, status))
    for row in failed:
        console.print(f"[red]job #{row.job} {row.status}[/red] ({escape(row.varies)}): {escape(row.error)}")
    for row in refused:
        console.print(f"[yellow]job #{row.job} not taken from an earlier run[/yellow]: {escape(row.error)}")
    if best is not None and paper is None:  # across datasets, the fastest row compares nothing comparable
        console.print(escape(best.line(short_names(varying_keys(rows)))))
    console.print(
        f"sweep run: {run_url(client, experiment_id, parent_run_id)}", soft_wrap=True, markup=False, highlight=False
    )
    return status


# The terminal table's labels for the keys sweeps vary most, as run names write them (`T=0 bs=8`): the
# short values of these keys under their long names made the default grid's table 84 columns wide.
TABLE_LABELS = {"decode.temperature": "T", "decode.block_size": "bs", "decode.tree_budgets": "budgets"}


def _table(rows: list[Row], status: str) -> Table:
    """The terminal's version, fitted to 80 columns: each varying key a short column of its own, a job's
    settings on its first row only, and a status column only when some job did not finish (the title says
    the sweep's). The method and the figures (the speedup is the sweep's answer) are never cut: each keeps
    its whole width, and where the row is still too wide the settings and the model wrap instead."""
    keys = varying_keys(rows)
    names = {key: TABLE_LABELS.get(key, name) for key, name in short_names(keys).items()}
    mixed = any(row.status != "FINISHED" for row in rows)
    title = f"Sweep summary: [{STATUS_STYLE.get(status, 'white')}]{status}[/]"
    # No borders and one space between columns: three varying keys and the figures still fit 80 columns.
    table = Table(title=title, title_justify="left", box=None, padding=(0, 1, 0, 0), header_style="bold underline")
    cells = [(row, figure_cells(row)) for row in rows]

    def whole(header: str, values: list[str]) -> int:
        return max(cell_len(text) for text in [header, *values])

    table.add_column("job", no_wrap=True, min_width=whole("job", [str(row.job) for row in rows]))
    if mixed:
        table.add_column("status", no_wrap=True, min_width=len("FINISHED"))
    for key in keys:
        table.add_column(names[key], overflow="fold")
    table.add_column("method", no_wrap=True, min_width=whole("method", [row.method for row in rows]))
    for index, (name, _, _) in enumerate(FIGURES):
        table.add_column(name, no_wrap=True, justify="right", min_width=whole(name, [c[index] for _, c in cells]))
    previous = None
    for row, figures in cells:
        first = row.job != previous
        previous = row.job
        style = STATUS_STYLE.get(row.status, "white")
        settings = row.settings()
        table.add_row(
            str(row.job) if first else "",
            *([f"[{style}]{row.status}[/]" if first else ""] if mixed else []),
            *((escape(settings.get(k, "")) if first else "") for k in keys),
            row.method,
            *figures,
        )
    return table
