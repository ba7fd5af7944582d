"""What a sweep's parent run shows in MLflow: its description, the grid as params, each job's headline metrics.

The parent is where a researcher lands from the experiment's runs table, so it answers the sweep's question
first (which setting and method was fastest, by how much, on how many passes), then gives the table one row
per job × method with the keys the sweep varies as their own short columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.sweep.rows import INTERVALS, Row, short_names, varying_keys
from orchestrator.tracking.job_summary import SPEEDUP_CI, TAU_CI, VS_DFLASH, cell
from orchestrator.tracking.markdown_table import markdown_table
from remote_worker.decoding.figure_rules import AR_BY_DEFINITION, MIN_PROMPTS
from remote_worker.wording import counted

# The per-method figures each job contributes to the parent's metrics: `job3.ddtree_tb32.speedup_vs_ar`, and
# where the method has them the 95 % intervals over prompts (`job3.ddtree_tb32.tau_ci_low`, …).
JOB_METRICS = ("tau", "speedup_vs_ar", "tokens_per_s", "lossless", *INTERVALS)
# The figures' columns in the description and the terminal: (header, Row field, format).
FIGURES = (("tau", "tau", "{:.2f}"), ("×AR", "speedup_vs_ar", "×{:.2f}"), ("tok/s", "tokens_per_s", "{:.1f}"),
           ("lossless", "lossless", "{:.2f}"))  # fmt: skip
# The description's columns for the intervals over prompts and DDTree over DFlash, each after the figure it
# belongs to (by Row field) and only where some row has it; the terminal's table keeps to its 80 columns.
# (header, Row fields, format); a "vs DFlash" without its interval (one prompt) shows the ratio alone.
# The cells are the job page's (`job_summary.cell`), keys and formats alike.
INTERVAL_COLUMNS = {
    "tau": (("tau 95% CI", TAU_CI, "{:.2f}–{:.2f}"),),
    "speedup_vs_ar": (
        ("×AR 95% CI", SPEEDUP_CI, "×{:.2f}–{:.2f}"),
        ("vs DFlash", VS_DFLASH, "×{:.2f} ({:.2f}–{:.2f})"),
    ),
}


def figure_cells(row: Row) -> list[str]:
    """The row's figures as the tables show them (blank where the run has none, e.g. lossless at T > 0)."""
    return ["" if (value := getattr(row, key)) is None else form.format(value) for _, key, form in FIGURES]


def interval_cell(row: Row, keys: tuple[str, ...], form: str) -> str:
    """An interval column's cell as the job page writes it: blank where the row has none (AR, one prompt),
    the ratio alone for a `vs DFlash` without its interval."""
    return cell(vars(row), keys, form)


def description_columns(rows: list[Row]) -> list[tuple[str, Callable[[Row], str]]]:
    """The description's figure columns: FIGURES, each followed by its interval columns that some row has."""
    columns: list[tuple[str, Callable[[Row], str]]] = []
    for index, (name, key, _) in enumerate(FIGURES):
        columns.append((name, lambda row, index=index: figure_cells(row)[index]))
        for header, keys, form in INTERVAL_COLUMNS.get(key, ()):
            if any(interval_cell(row, keys, form) for row in rows):
                columns.append((header, lambda row, keys=keys, form=form: interval_cell(row, keys, form)))
    return columns


@dataclass(frozen=True)
class Fastest:
    """The drafting method with the highest speedup over AR, and whether it is crowned: only where its 95 %
    interval over prompts clears the runner-up's (`rival`), as a job's own verdict (`remote_worker.experiments.
    verdict`); a fastest median alone once crowned a job whose interval, 0.73–1.80, held 1."""

    row: Row
    rival: Row | None = None

    @property
    def crowned(self) -> bool:
        if self.rival is None:  # the only drafting method: crowned on an interval, as a job's verdict crowns
            return _interval(self.row) is not None
        mine, theirs = _interval(self.row), _interval(self.rival)
        return mine is not None and theirs is not None and mine[0] > theirs[1]

    def line(self, names: dict[str, str]) -> str:
        """`Fastest: job #3 (block_size=8) ddtree_tb32: tau 4.53, ×2.13 (1.98–2.30) vs AR, lossless · clears
        job #1 dflash (1.10–1.30) · one pass per prompt`, or, where the intervals overlap or are missing, `No
        clear fastest: …` with the runner-up and why."""
        row = self.row
        figures = [f"tau {row.tau:.2f}" if row.tau is not None else "", f"×{row.speedup_vs_ar:.2f}{_ci(row)} vs AR"]
        if row.lossless is not None:
            figures.append("lossless" if row.lossless == 1 else f"lossless {row.lossless:.2f}")
        passes = "one pass per prompt" if (row.repeats or 1) == 1 else f"median of {row.repeats} passes"
        slower = " (slower than AR)" if row.speedup_vs_ar < 1 else ""
        lead = f"{_job(row, names)} {row.method}: {', '.join(f for f in figures if f)}{slower}"
        rival = self.rival
        if rival is None:
            if self.crowned:
                return f"Fastest: {lead} · the only drafting method · {passes}"
            return f"No clear fastest: {lead} · the only drafting method, with no 95 % interval · {passes}"
        other = f"{_job(rival, names)} {rival.method} ×{rival.speedup_vs_ar:.2f}{_ci(rival)}"
        if self.crowned:
            return f"Fastest: {lead} · its interval clears the runner-up's, {other} · {passes}"
        if _interval(row) is None or _interval(rival) is None:
            why = f"no 95 % intervals (fewer than {MIN_PROMPTS} prompts) to tell it from the runner-up, {other}"
        else:
            why = f"its interval overlaps the runner-up's, {other}"
        return f"No clear fastest: {lead} · {why} · {passes}"


def _interval(row: Row) -> tuple[float, float] | None:
    low, high = row.speedup_vs_ar_ci_low, row.speedup_vs_ar_ci_high
    return None if low is None or high is None else (low, high)


def _job(row: Row, names: dict[str, str]) -> str:
    where = ", ".join(f"{names.get(k, k)}={v}" for k, v in row.settings().items())
    return f"job #{row.job}" + (f" ({where})" if where else "")


def _ci(row: Row) -> str:
    """` (2.10–2.50)`: the speedup's 95 % interval over prompts, where the run has one."""
    interval = _interval(row)
    return "" if interval is None else f" ({interval[0]:.2f}–{interval[1]:.2f})"


def fastest(rows: list[Row]) -> Fastest | None:
    """The drafting method of a finished job with the highest speedup over AR and its runner-up (None when
    there is none)."""
    drafting = [r for r in rows if r.kind in ("dflash", "ddtree") and r.speedup_vs_ar is not None]
    finished = [r for r in drafting if r.status == "FINISHED"] or drafting
    ranked = sorted(finished, key=lambda r: r.speedup_vs_ar or 0.0, reverse=True)
    if not ranked:
        return None
    return Fastest(ranked[0], ranked[1] if len(ranked) > 1 else None)


def description(rows: list[Row], status: str) -> str:
    """The parent's description (Markdown): the answer in one line, then one row per job × method."""
    keys = varying_keys(rows)
    names = short_names(keys)
    finished = sum(1 for job in {r.job: r for r in rows}.values() if job.status == "FINISHED")
    jobs = len({r.job for r in rows})
    varies = f" · varies {', '.join(names[k] for k in keys)}" if keys else ""
    lines = [f"**Sweep {status}: {finished} of {counted(jobs, 'job')} finished**{varies}", ""]
    best = fastest(rows)
    lines += [best.line(names) if best is not None else "No drafting method has a speedup to compare.", ""]
    figures = description_columns(rows)
    header = ["job", "status", *(names[k] for k in keys), "method", *(name for name, _ in figures)]
    body = []
    for row in rows:
        settings = row.settings()
        status = f"{row.status} (reused: {row.run_id[:8]})" if row.reused else row.status
        cells = [str(row.job), status, *(settings.get(k, "") for k in keys), row.method]
        body.append(cells + [cell(row) for _, cell in figures])
    lines += markdown_table(header, body)
    errors = [f"- job #{r.job} {r.status}: {r.error}" for r in {r.job: r for r in rows}.values() if r.error]
    if errors:
        lines += ["", *errors]
    return "\n".join(lines) + "\n"


def grid_params(rows: list[Row], swept: list[str]) -> dict[str, str]:
    """The grid as params: each swept key and the values its jobs took, in job order (`decode.block_size`:
    `4,8`)."""
    values: dict[str, list[str]] = {key: [] for key in swept}
    for row in {r.job: r for r in rows}.values():
        given = row.given()
        for key in swept:
            if key in given and given[key] not in values[key]:
                values[key].append(given[key])
    return {key: ",".join(found) for key, found in values.items() if found}


def job_metrics(rows: list[Row]) -> dict[str, float]:
    """The crowned fastest's figures under `best.*` (none where no method is crowned), then every job's per
    method (`job3.ddtree_tb32.speedup_vs_ar`), in that order: MLflow's run page lists metrics as first
    logged, so the answer leads."""
    metrics: dict[str, float] = {}
    best = fastest(rows)
    if best is not None and best.crowned:
        for key in ("speedup_vs_ar", "tau", "tokens_per_s"):
            if (value := getattr(best.row, key)) is not None:
                metrics[f"best.{key}"] = float(value)
    for row in rows:
        for key in JOB_METRICS:
            if row.method == "ar" and key in AR_BY_DEFINITION:
                continue
            if row.method and (value := getattr(row, key)) is not None:
                metrics[f"job{row.job}.{row.method}.{key}"] = float(value)
    return metrics
