"""The paper's table as a part of a sweep's page: read the jobs that decoded a paper dataset back from MLflow,
and give the description its table, the parent run `paper_table.csv` and `paper_table.png`.

A job counts when it FINISHED and its params name one of the ten datasets (`experiment.prompts`); its records
come from its own `generations.jsonl` and its budget curve from its `decode_summary.json`. A job whose files
cannot be read is named in a line under the table, never silently dropped.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from orchestrator.sweep.paper.figures import RecordsDisagree
from orchestrator.sweep.paper.table import (
    DATASETS,
    PAPER_MODELS,
    Entry,
    JobRecords,
    Missing,
    entries,
    load_job,
    markdown,
    paper_figures,
    terminal_lines,
    write_csv,
)
from orchestrator.sweep.rows import Row
from orchestrator.tracking.plots import VIEWER_WIDTH_IN, pyplot, save_figure

if TYPE_CHECKING:
    import matplotlib.pyplot as plt

GENERATIONS, SUMMARY = "generations.jsonl", "decode_summary.json"
CSV_FILE, FIGURE_FILE = "paper_table.csv", "paper_table.png"


@dataclass
class PaperSection:
    markdown: str
    files: list[Path] = field(default_factory=list)
    terminal: list[str] = field(default_factory=list)  # the table at 80 columns, for the sweep's last screen


def missing_entries(rows: Sequence[Row], grid: Sequence[Mapping[str, str]] | None) -> list[Missing]:
    """Each (dataset, temperature) a job of the sweep was to decode and did not: its reason, once. A job with
    no run (a config error) is placed by the sweep's grid."""
    finished, missing = set(), {}
    for row in rows:
        given = dict(row.given())
        if not given.get("experiment.prompts") and grid is not None and 0 <= row.job < len(grid):
            given = dict(grid[row.job])
        dataset = given.get("experiment.prompts", "")
        if dataset not in DATASETS:
            continue
        try:
            key = (dataset, float(given.get("decode.temperature") or 0))
        except ValueError:
            continue
        if row.status == "FINISHED":
            finished.add(key)
        else:
            missing.setdefault(key, row.error or f"the job ended {row.status}")
    return [Missing(d, t, why) for (d, t), why in missing.items() if (d, t) not in finished]


def paper_jobs(client: MlflowClient, rows: Sequence[Row], folder: Path) -> tuple[list[JobRecords], list[str]]:
    """The FINISHED jobs that decoded a paper dataset, with their records; and a line per job left out."""
    jobs, left_out = [], []
    seen: set[str] = set()
    for row in rows:
        if row.status != "FINISHED" or not row.run_id or row.run_id in seen:
            continue
        seen.add(row.run_id)
        try:
            run = client.get_run(row.run_id)
            dataset = run.data.params.get("experiment.prompts", "")
            if dataset not in DATASETS:
                continue
            where = folder / row.run_id
            where.mkdir()
            generations = Path(client.download_artifacts(row.run_id, GENERATIONS, str(where)))
            try:
                summary: Path | None = Path(client.download_artifacts(row.run_id, SUMMARY, str(where)))
            except (MlflowException, OSError):
                summary = None
            temperature = float(run.data.params.get("decode.temperature", "0"))
            new_tokens = int(run.data.params.get("decode.max_new_tokens") or 0)
            jobs.append(load_job(generations, summary, dataset, temperature, row.model, new_tokens))
        except (MlflowException, OSError, ValueError, KeyError) as exc:
            left_out.append(f"job #{row.job} ({row.run_id}) left out: {type(exc).__name__}: {str(exc)[:200]}")
    return jobs, left_out


def paper_section(
    client: MlflowClient, rows: Sequence[Row], out: Path, grid: Sequence[Mapping[str, str]] | None = None
) -> PaperSection | None:
    """The table, its CSV and its figure in `out`, one table per model; None when no job decoded a paper set.
    A dataset whose jobs failed keeps its row, with the reason (`grid`: each job's settings, by number)."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs, left_out = paper_jobs(client, rows, Path(tmp))
    missing = missing_entries(rows, grid)
    if not jobs:
        return None
    parts, files, terminal = [], [], []
    models = sorted({job.model for job in jobs})
    for model in models:
        chosen = [job for job in jobs if job.model == model]
        lost = missing if len(models) == 1 else []  # a failed job's model is not known: one model's table only
        try:
            found = entries(chosen)
        except RecordsDisagree as exc:
            parts.append(f"### The paper's table: {model}\n\nNot drawn: {exc} (the shards' settings differ).\n")
            continue
        parts.append(markdown(found, model, lost))
        terminal += [*terminal_lines(found, model, lost), ""]
        suffix = "" if len(parts) == 1 else f"_{model}"
        csv_path = out / CSV_FILE.replace(".csv", f"{suffix}.csv")
        figure_path = out / FIGURE_FILE.replace(".png", f"{suffix}.png")
        write_csv(found, model, csv_path)
        files += [csv_path, save_figure(draw(found, model), figure_path)]
    text = "\n".join(parts) + "".join(f"\n{line}\n" for line in left_out)
    return PaperSection(text, files, terminal)


def draw(found: Sequence[Entry], model: str) -> plt.Figure:
    """Speedup over AR per dataset: DFlash and DDTree (its best budget) at each temperature, with 95 % intervals;
    the paper's figure as a black tick where it reports the model."""
    paper_model = PAPER_MODELS.get(model)
    paper = paper_figures() if paper_model else {}
    temperatures = sorted({e.temperature for e in found})
    datasets = [d for d in DATASETS if any(e.dataset == d for e in found)]
    size = (VIEWER_WIDTH_IN, 3.6 * len(temperatures) + 0.8)
    fig, axes = pyplot().subplots(len(temperatures), 1, figsize=size, squeeze=False)
    width = 0.38
    for axis, t in zip((a[0] for a in axes), temperatures, strict=True):
        by_dataset = {e.dataset: e for e in found if e.temperature == t}
        for offset, method, colour in ((-width / 2, "dflash", "tab:blue"), (width / 2, "ddtree", "tab:orange")):
            xs, ys, low, high = [], [], [], []
            for x, dataset in enumerate(datasets):
                c = getattr(by_dataset.get(dataset), method, None) if dataset in by_dataset else None
                if c is None:
                    continue
                xs.append(x + offset)
                ys.append(c.speedup)
                low.append(c.speedup - c.speedup_ci.low if c.speedup_ci else 0.0)
                high.append(c.speedup_ci.high - c.speedup if c.speedup_ci else 0.0)
                figure = paper.get((paper_model, dataset, t, method)) if paper_model else None
                if figure is not None:
                    axis.plot([x + offset - width / 2, x + offset + width / 2], [figure.speedup] * 2, color="black")
            label = "DFlash" if method == "dflash" else "DDTree (best budget)"
            errors = [low, high] if any(low) or any(high) else None  # no interval under 5 records: no bar for one
            axis.bar(xs, ys, width, yerr=errors, color=colour, label=label, capsize=2)
        axis.axhline(1.0, linestyle=":", color="grey")
        axis.set_xticks(range(len(datasets)), datasets, rotation=30, ha="right", fontsize="small")
        axis.set_ylabel("speedup vs AR")
        title = f"{model} · T={t:g}" + (f" (black: the paper's {paper_model})" if paper_model else "")
        axis.set_title(title, fontsize="small")
    axes[-1][0].legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, frameon=False)
    fig.tight_layout()
    return fig
