"""The summary a sweep's parent run gets when the multirun ends: a table of every job and method, plots.

Everything is read back from MLflow (the job runs under the parent, the method runs under each job), so
the summary is the same whichever launcher ran the jobs and wherever they ran.
"""

from __future__ import annotations

import csv
import tempfile
from dataclasses import fields
from pathlib import Path

from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.table import Table

from orchestrator.sweep.plot import plot_sweep
from orchestrator.sweep.rows import Row, sweep_rows
from orchestrator.tracking import tags as mlflow_tags
from orchestrator.tracking.status import STATUS_STYLE

CSV_FILE, MARKDOWN_FILE = "sweep_summary.csv", "sweep_summary.md"


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def write_csv(rows: list[Row], path: Path) -> None:
    names = [f.name for f in fields(Row)]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for row in rows:
            writer.writerow(["" if getattr(row, n) is None else getattr(row, n) for n in names])


def write_markdown(rows: list[Row], path: Path) -> None:
    names = [f.name for f in fields(Row) if f.name != "overrides"]  # the CSV has them all
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for row in rows:
        cells = [_cell(getattr(row, n)).replace("|", "\\|") for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def sweep_status(rows: list[Row]) -> str:
    statuses = {row.status for row in rows}
    if "FAILED" in statuses:
        return "FAILED"
    if "KILLED" in statuses:
        return "KILLED"
    return "FINISHED"


def summarize_sweep(
    client: MlflowClient, experiment_id: str, parent_run_id: str, console: Console, job_dirs: dict[int, str]
) -> str:
    """Log the summary into the parent run, end it, print the table; return the sweep's status.

    `job_dirs` maps every job Hydra launched to the error it recorded before it had a run (or ""): a job
    without a run is a FAILED row, never a silent gap."""
    rows = sweep_rows(client, parent_run_id)
    with_runs = {row.job for row in rows}
    for job, error in sorted(job_dirs.items()):
        if job not in with_runs:
            reason = error or "the job ended before it created its MLflow run"
            rows.append(Row(job=job, status="FAILED", model="", overrides="", error=reason))
    rows.sort(key=lambda row: row.job)
    status = sweep_status(rows) if rows else "FAILED"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_csv(rows, folder / CSV_FILE)
        write_markdown(rows, folder / MARKDOWN_FILE)
        client.log_artifact(parent_run_id, str(folder / CSV_FILE))
        client.log_artifact(parent_run_id, str(folder / MARKDOWN_FILE))
        for figure in plot_sweep(rows, folder):
            client.log_artifact(parent_run_id, str(figure), artifact_path="plots")
    jobs = {row.job: row for row in rows}
    failed = [row for row in jobs.values() if row.status != "FINISHED"]
    client.set_tag(parent_run_id, mlflow_tags.SWEEP_JOBS, str(len(jobs)))
    client.set_tag(parent_run_id, mlflow_tags.SWEEP_NOT_FINISHED, str(len(failed)))
    client.set_terminated(parent_run_id, status)
    console.print(_table(rows, status))
    for row in failed:
        console.print(f"[red]job #{row.job} {row.status}[/red] ({row.varies}): {row.error}")
    return status


def _short(override: str) -> str:
    """`decode.temperature=1` → `temperature=1`: fits an 80-column terminal without folding mid-word."""
    key, sep, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}{sep}{value}"


def _table(rows: list[Row], status: str) -> Table:
    """The terminal's version: a job's overrides on its first row only, short headers."""
    table = Table(title=f"Sweep summary: [{STATUS_STYLE.get(status, 'white')}]{status}[/]", title_justify="left")
    table.add_column("job", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("varies", overflow="fold")
    for name in ("method", "tau", "×AR", "tok/s", "lossless"):
        table.add_column(name, no_wrap=True)
    previous = None
    for row in rows:
        first = row.job != previous
        previous = row.job
        style = STATUS_STYLE.get(row.status, "white")
        table.add_row(
            str(row.job) if first else "",
            f"[{style}]{row.status}[/]" if first else "",
            "\n".join(_short(o) for o in row.varies.split()) if first else "",
            row.method,
            *(_cell(getattr(row, k)) for k in ("tau", "speedup_vs_ar", "tokens_per_s", "lossless")),
            end_section=False,
        )
    return table
