"""The commands that look rather than run: `list` (what is on a host) and `logs` (what a worker said), and
how a run is named on the command line (`find_run`: an id, a unique prefix, or `last`).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass

from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.table import Table

from orchestrator.config.settings import JobConfig
from orchestrator.config.validation import ConfigError
from orchestrator.host.launch import STDERR_FILE, worker_status
from orchestrator.host.transport import Transport
from orchestrator.stream.events import EVENTS_FILE, parse_chunk
from orchestrator.tracking import tags
from orchestrator.tracking.client import outages_named

MAX_RUNS = 1000


def host_runs(client: MlflowClient, host: str) -> list[Run]:
    """The job runs of `host` in MLflow (no method children, no sweep parents), newest first."""
    with outages_named():
        experiments = [e.experiment_id for e in client.search_experiments()]
        found = client.search_runs(
            experiments, f"tags.`{tags.HOST}` = '{host}'", max_results=MAX_RUNS, order_by=["attributes.start_time DESC"]
        )
    return [r for r in found if tags.SCOPE not in r.data.tags and tags.ROLE not in r.data.tags]


def find_run(client: MlflowClient, config: JobConfig) -> str:
    """The full run id the command line names: itself, the one run whose id starts with it, or `last`."""
    reference = str(config.run_id)
    if len(reference) == 32:
        return reference
    runs = host_runs(client, config.host.name)
    if reference == "last":  # attach and cancel mean the newest one still running, if there is one
        running = [r for r in runs if r.info.status == "RUNNING"]
        chosen = running if running and config.command.value in ("attach", "cancel") else runs
        if not chosen:
            raise ConfigError(f"no run of host {config.host.name} in this tracking store")
        return chosen[0].info.run_id
    matches = [r.info.run_id for r in runs if r.info.run_id.startswith(reference)]
    if not matches:
        raise ConfigError(f"no run of host {config.host.name} has an id starting with {reference}")
    if len(matches) > 1:
        raise ConfigError(
            f"{reference} names {len(matches)} runs ({', '.join(m[:8] for m in matches[:4])}…): give more"
        )
    return matches[0]


# -- list ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    run_id: str
    model: str
    started: float | None  # unix seconds
    ended: float | None
    state: str  # the worker's (running, waiting) or the run's MLflow status
    progress: str
    tau: str


def list_runs(console: Console, transport: Transport, config: JobConfig, client: MlflowClient | None) -> int:
    """The runs whose worker is alive on the host (with `list_all`, every run of the host in MLflow too)."""
    runs_dir = posixpath.join(config.host.workdir, "runs")
    names = transport.run(["sh", "-c", 'ls -1 "$1" 2>/dev/null || true', "ls", runs_dir]).stdout.split()
    alive = {}
    for name in sorted(names):
        status = worker_status(transport, posixpath.join(runs_dir, name))
        if status.alive:
            alive[name] = status.state
    known = {r.info.run_id: r for r in host_runs(client, config.host.name)} if client is not None else {}
    rows = [_listed(run_id, known.get(run_id), state) for run_id, state in alive.items()]
    if config.list_all:
        rows += [_listed(run_id, run, None) for run_id, run in known.items() if run_id not in alive]
    what = "runs" if config.list_all else "active runs"
    if not rows:
        console.print(f"no {what} on {config.host.name} (under {runs_dir})")
        return 0
    table = Table(title=f"{what} on {config.host.name}", title_justify="left")
    for column in ("run", "model", "started", "elapsed", "state", "progress", "tau"):
        table.add_column(column, no_wrap=column in ("run", "started", "elapsed"))
    for row in rows:
        table.add_row(
            row.run_id[:8],
            row.model,
            _clock(row.started),
            _elapsed(row.started, row.ended),
            row.state,
            row.progress,
            row.tau,
        )
    console.print(table)
    console.print("(a run is named by these 8 characters in attach=, cancel= and logs=)", style="dim")
    return 0


def _listed(run_id: str, run: Run | None, worker_state: str | None) -> Listed:
    if run is None:
        return Listed(run_id, "?", None, None, worker_state or "?", "", "")
    data, info = run.data, run.info
    tau = data.metrics.get("best.tau")
    return Listed(
        run_id,
        data.tags.get(tags.MODEL, "?"),
        info.start_time / 1000 if info.start_time else None,
        info.end_time / 1000 if info.end_time else None,
        worker_state or info.status,
        data.tags.get(tags.PROGRESS, "") if worker_state else "",
        f"{tau:.2f}" if tau is not None else "",
    )


def _clock(started: float | None) -> str:
    return time.strftime("%m-%d %H:%M", time.localtime(started)) if started else ""


def _elapsed(started: float | None, ended: float | None) -> str:
    if not started:
        return ""
    seconds = int((ended or time.time()) - started)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# -- logs ---------------------------------------------------------------------------------------------------


def print_logs(
    console: Console,
    transport: Transport,
    run_dir: str,
    follow: bool,
    poll_interval_s: float,
    check_interrupt: Callable[[], None],
) -> int:
    """The worker's stderr, then its `log` and `traceback` events; with `follow`, new lines as they come,
    until the worker is gone."""
    stderr_at = events_at = 0
    stderr_path, events_path = posixpath.join(run_dir, STDERR_FILE), posixpath.join(run_dir, EVENTS_FILE)
    while True:
        gone = follow and not worker_status(transport, run_dir).alive  # asked first: what follows is all
        while True:  # everything written so far (whole lines while the worker may still add to them)
            stderr = transport.read_bytes(stderr_path, stderr_at, 1 << 20)
            end = stderr.rfind(b"\n") + 1 if follow and not gone else len(stderr)
            for line in stderr[:end].decode(errors="replace").splitlines():
                console.print(f"stderr  {line}", markup=False, highlight=False, soft_wrap=True)
            stderr_at += end
            chunk = transport.read_bytes(events_path, events_at, 4 << 20)
            events, _bad, consumed = parse_chunk(chunk, events_at)
            events_at += consumed
            for event in events:
                data = event.data if isinstance(event.data, dict) else {"message": event.data}
                if event.kind in ("log", "traceback"):
                    when = time.strftime("%H:%M:%S", time.localtime(event.t))
                    text = data.get("message") or data.get("error") or ""
                    console.print(f"{when} {event.kind:<9} {text}", markup=False, highlight=False, soft_wrap=True)
            if end == 0 and consumed == 0:
                break
        if not follow or gone:
            return 0
        check_interrupt()
        time.sleep(poll_interval_s)
