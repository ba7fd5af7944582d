"""The commands besides run-and-follow: list the runs active on a host, cancel one."""

from __future__ import annotations

import posixpath
from typing import Any

from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.table import Table

from orchestrator.launch import stop_worker, worker_status
from orchestrator.state import StateStore, StreamState
from orchestrator.stream import drain
from orchestrator.tracking.runs import finish
from orchestrator.tracking.sink import MlflowSink
from orchestrator.transport import Transport


def list_runs(console: Console, transport: Transport, host: dict[str, Any]) -> int:
    """Print the runs whose worker is alive on the host."""
    runs_dir = posixpath.join(host["workdir"], "runs")
    names = transport.run(["sh", "-c", 'ls -1 "$1" 2>/dev/null || true', "ls", runs_dir]).stdout.split()
    table = Table(title=f"active runs on {host['name']}", title_justify="left")
    for column in ("mlflow run", "state", "pid"):
        table.add_column(column)
    active = 0
    for name in sorted(names):
        status = worker_status(transport, posixpath.join(runs_dir, name))
        if status.alive:
            active += 1
            table.add_row(name, status.state, str(status.pid or ""))
    if active:
        console.print(table)
    else:
        console.print(f"no active runs on {host['name']} (under {runs_dir})")
    return 0


def cancel_run(
    console: Console,
    client: MlflowClient,
    transport: Transport,
    experiment_id: str,
    state: StreamState,
    store: StateStore,
    grace_s: float,
) -> int:
    """Stop the run's worker (SIGTERM, then SIGKILL), apply what it wrote last, end the run KILLED."""
    final = stop_worker(transport, state.run_dir, grace_s)
    sink = MlflowSink(client, experiment_id, state, store, transport)
    drain(transport, sink, lambda _event: None)
    client.set_tag(state.run_id, "error", "cancelled by the user")
    client.set_tag(state.run_id, "failure_stage", "cancel")
    finish(client, sink.run_ids(), "KILLED")
    console.print(f"cancelled {state.run_id}: {final.describe()}; the run ends KILLED")
    return 0
