"""`list=true`: the runs whose worker is alive on a host."""

from __future__ import annotations

import posixpath
from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator.launch import worker_status
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
