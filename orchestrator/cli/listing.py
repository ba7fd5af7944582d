"""`list=true` and `list=all`: the runs on a host, from the host itself (what runs there now) and the tracking store."""

from __future__ import annotations

import posixpath
import sys
import time
from dataclasses import dataclass

from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator.cli import context
from orchestrator.cli.context import TransportFactory
from orchestrator.cli.run_ref import host_runs
from orchestrator.config.commands import attach_command
from orchestrator.config.settings import JobConfig
from orchestrator.config.text import printable
from orchestrator.config.validation import ConfigError
from orchestrator.host.run_folder import WorkerStatus, worker_status
from orchestrator.host.transport import Transport, UnsafePath
from orchestrator.stream.events import EVENTS_FILE, Event, parse_chunk, progress_text
from orchestrator.tracking import tags
from orchestrator.tracking.client import TrackingUnavailable
from orchestrator.tracking.status import RunStatus

UNRECORDED = "ended, not recorded yet"  # the worker is gone, the run RUNNING in MLflow: `attach` records its end
WRAP_AT = 12  # the narrowest a wrapping column of the list gets (`ended, not` / `recorded yet`)
PROGRESS_ROOM = 24  # what the list's progress column gets before the others wrap or give way
KINDS = {"ddtree_gdn": "decode", "probe": "probe", "node_cost": "node cost"}  # experiment → the list's `what`
LOG_TAIL_BYTES = 256 * 1024  # enough for the last progress event and the end's best.* lines


# -- list ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    run_id: str
    model: str
    started: float | None  # unix seconds
    ended: float | None
    state: str  # the worker's (running, waiting), "ended, not recorded yet", or the run's MLflow status
    progress: str
    tau: str
    last_event: float | None = None  # unix seconds of the worker's newest event (a live worker's only)
    what: str = ""  # decode, probe, node cost; `sweep #3` for a sweep's job


@dataclass(frozen=True)
class LogReport:
    """What a run's own event log on the host says: where the worker is, and its best method's tau once the
    worker has reported it. Read from the host, since a detached run's MLflow tags wait for an `attach`."""

    progress: str = ""
    tau: str = ""
    ended: float | None = None  # the worker's `end` event's time
    last: float | None = None  # the newest event's time: how long a live worker has been quiet


def list_runs(console: Console, transport: Transport, config: JobConfig, client: MlflowClient | None) -> int:
    """The runs whose worker is alive on the host, and those whose worker has ended while MLflow still says
    RUNNING (nobody recorded the end: `attach` does); with `list_all`, every run of the host in MLflow too."""
    runs_dir = posixpath.join(config.host.workdir, "runs")
    names = transport.run(["sh", "-c", 'ls -1 "$1" 2>/dev/null || true', "ls", runs_dir]).stdout.split()
    known = {r.info.run_id: r for r in host_runs(client, config.host.name)} if client is not None else {}
    active: dict[str, str] = {}  # run id: what the list says of its worker
    for name in sorted(names):
        status = worker_status(transport, posixpath.join(runs_dir, name))
        if status.alive:
            active[name] = status.state
        elif _unrecorded(status, known.get(name)):
            active[name] = UNRECORDED
    rows = [
        _listed(run_id, known.get(run_id), state, read_log_report(transport, posixpath.join(runs_dir, run_id)))
        for run_id, state in active.items()
    ]
    if config.list_all:
        rows += [_listed(run_id, run, None, None) for run_id, run in known.items() if run_id not in active]
    what = "runs" if config.list_all else "active runs"
    if not rows:
        console.print(f"no {what} on {config.host.name} (under {runs_dir})")
        return 0
    console.print(f"[bold]{what} on {escape(config.host.name)}[/bold]")
    table = runs_table(rows, console.width, started=config.list_all)
    console.print(table)
    if not any(column.header == "progress" for column in table.columns):  # no room beside the rest: below it
        for row in rows:
            if row.progress:
                console.print(f"{row.run_id[:8]}  {escape(printable(row.progress))}")
    for row in rows:
        if row.state == UNRECORDED:  # the whole command, never folded: it is to be pasted
            line = f"{row.run_id[:8]} {UNRECORDED}: {attach_command(config, row.run_id)}"
            console.print(line, soft_wrap=True, markup=False, highlight=False)
    console.print("(a run is named by these 8 characters in attach=, cancel= and logs=)", style="dim")
    return 0


def runs_table(rows: list[Listed], width: int, *, started: bool) -> Table:
    """The rows as a table that fits `width` without cutting a word (left to itself, rich narrows every column
    alike and cuts run ids and method names to `ddtree_…`): the progress, last, takes the room the others
    leave and wraps; where that is too little, the state and tau wrap at spaces. Where there is still too
    little (for list=all, which keeps `started`: any less than its wish), the progress is printed below the
    table instead, and in list=all `elapsed` gives way to `started` if need be. Without any progress to show
    (finished runs only), there is no progress column."""
    cells = [
        {  # tags and the host's log are foreign text: control characters escaped
            "run": row.run_id[:8],
            "model": printable(row.model)[:40],
            "started": _clock(row.started),
            "elapsed": _elapsed(row.started, row.ended),
            "state": printable(row.state),
            "tau": printable(row.tau)[:60],
            "progress": printable(row.progress)[:200],
            "quiet": _ago(row.last_event),
            "what": printable(row.what)[:40],
        }
        for row in rows
    ]
    names = ["run", "model", *(["what"] * any(cell["what"] for cell in cells)), *(["started"] * started)]
    names += ["elapsed", "state", *(["quiet"] * any(cell["quiet"] for cell in cells)), "tau"]
    names += ["progress"] * any(cell["progress"] for cell in cells)  # none: its room goes to the rest
    widths = {name: max(cell_len(text) for text in [name, *(cell[name] for cell in cells)]) for name in names}
    wanted = min(widths.get("progress", 0), PROGRESS_ROOM)

    def room() -> int:
        return width - sum(widths[name] for name in names if name != "progress") - 2 * (len(names) - 1)

    if room() < wanted:
        for name in ("state", "tau"):
            longest_word = max(cell_len(word) for text in [name, *(c[name] for c in cells)] for word in text.split())
            widths[name] = min(widths[name], max(WRAP_AT, longest_word))
    least = max([8, *(cell_len(word) for c in cells for word in c["progress"].split())])  # no word cut
    if "progress" in names and (room() < least or (room() < wanted and started)):
        names.remove("progress")  # no room for it beside the rest: printed below the table, whole
    if started and room() < 0:  # list=all still too wide: `started` says when, `elapsed` goes
        names.remove("elapsed")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for name in names:
        if name == "progress":
            table.add_column(name, max_width=room())
        else:
            table.add_column(name, width=widths[name], no_wrap=name not in ("state", "tau"))
    for cell in cells:
        table.add_row(*(cell[name] for name in names))
    return table


def _unrecorded(status: WorkerStatus, run: Run | None) -> bool:
    """The worker is gone but its run is RUNNING in MLflow: its end waits for `attach` to record it."""
    return status.state in ("exited", "vanished") and run is not None and run.info.status == "RUNNING"


def _listed(run_id: str, run: Run | None, worker_state: str | None, report: LogReport | None) -> Listed:
    """One row: a run with a worker on the host (`worker_state`, `report` from its log) or one only in MLflow."""
    report = report or LogReport()
    last = report.last if worker_state in ("running", "waiting") else None
    if run is None:
        return Listed(run_id, "?", None, None, worker_state or "?", report.progress, report.tau, last)
    data, info = run.data, run.info
    tau = _best_tau(data.metrics, data.tags.get(tags.BEST_METHOD))
    job = data.tags.get(tags.SWEEP_JOB)
    kind = KINDS.get(data.params.get("experiment.name", ""), data.params.get("experiment.name", "?"))
    what = f"sweep #{job}" if job is not None else kind
    return Listed(
        run_id,
        data.tags.get(tags.MODEL, "?"),
        info.start_time / 1000 if info.start_time else None,
        report.ended or (info.end_time / 1000 if info.end_time else None),
        worker_state or info.status,
        report.progress,
        report.tau or tau,
        last,
        what,
    )


def _best_tau(metrics: dict[str, object], crowned: object) -> str:
    """`4.86 ddtree_tb64`: the crowned method's tau (`best.tau`), else the highest tau of the job's drafting
    methods (`<method>.tau` on the job's run), named: a run whose best was not crowned still has its taus."""
    if crowned and "best.tau" in metrics:
        return _tau(metrics["best.tau"], crowned)
    taus = {key[: -len(".tau")]: value for key, value in metrics.items() if key.endswith(".tau")}
    drafting = {method: value for method, value in taus.items() if method not in ("ar", "best") and "." not in method}
    if not drafting:
        return ""
    method = max(drafting, key=lambda name: (drafting[name], name))
    return _tau(drafting[method], method)


def _tau(value: object, method: object) -> str:
    """`4.86 ddtree_tb64`: a method's tau, named (each method has its own)."""
    if not isinstance(value, (int, float)):
        return ""
    return f"{value:.2f} {method}" if method else f"{value:.2f}"


def read_log_report(transport: Transport, run_dir: str) -> LogReport:
    """The last progress event and the best method's tau, from the tail of the run's events.jsonl (nothing
    where the safe file layer refuses the file: a link is not read)."""
    path = posixpath.join(run_dir, EVENTS_FILE)
    try:
        start = max(0, (transport.file_size(path) or 0) - LOG_TAIL_BYTES)
        chunk = transport.read_bytes(path, start, LOG_TAIL_BYTES)
    except UnsafePath:
        return LogReport()
    events, _cut_first_line, _ = parse_chunk(chunk, start)
    figures = {}
    for event in events:  # the job's own figures, the last value of each
        if event.kind == "metrics" and event.scope is None and isinstance(event.data, dict):
            figures.update(event.data)
    tau = _best_tau(figures, _last(events, "tags", tags.BEST_METHOD))
    end = next((event for event in reversed(events) if event.kind == "end"), None)
    last = max((event.t for event in events if not event.host_sample), default=None)
    return LogReport(_progress(events), tau, end.t if end is not None else None, last)


def _last(events: list[Event], kind: str, key: str) -> object:
    """The last value of `key` in the job's own events of `kind` (None if there is none)."""
    for event in reversed(events):
        if event.kind == kind and event.scope is None and isinstance(event.data, dict) and key in event.data:
            return event.data[key]
    return None


def _progress(events: list[Event]) -> str:
    """`ddtree_tb32 · prompt 3/8 · tau 4.53 · 300 tok/s · 12/40`, as the run's `progress` tag says it."""
    for event in reversed(events):
        if event.kind == "progress" and isinstance(event.data, dict):
            return progress_text(event.data)
    return ""


def _clock(started: float | None) -> str:
    """`14:05` today, `12-04` before: what tells runs apart, in the width list=all has at 80 columns."""
    if not started:
        return ""
    when, now = time.localtime(started), time.localtime()
    today = (when.tm_year, when.tm_yday) == (now.tm_year, now.tm_yday)
    return time.strftime("%H:%M" if today else "%m-%d", when)


def _ago(when: float | None) -> str:
    """`4s`, `1:05`, `2:00:07`: how long a live worker has been quiet (since its newest event)."""
    if when is None:
        return ""
    seconds = max(0, int(time.time() - when))
    if seconds < 60:
        return f"{seconds}s"
    minutes = f"{seconds % 3600 // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{minutes.zfill(5)}" if seconds >= 3600 else minutes


def _elapsed(started: float | None, ended: float | None) -> str:
    if not started:
        return ""
    seconds = int((ended or time.time()) - started)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# -- the command ---------------------------------------------------------------------------------------------


def command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """The runs whose worker is alive on the host; with list=all, every run of the host in MLflow too."""
    try:
        client: MlflowClient | None = context.open_tracking(config.tracking)
    except TrackingUnavailable as exc:
        if config.list_all:
            raise
        console.print(f"[yellow]{exc}: listing from the host alone[/yellow]")
        client = None
    transport = transport_for(config)
    try:
        transport.open()
        return list_runs(console, transport, config, client)
    except (TrackingUnavailable, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - every connect failure is the same one line a run gives
        print(f"{config.host.name}: {exc}", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    finally:
        transport.close()
