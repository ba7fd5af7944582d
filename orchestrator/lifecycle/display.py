"""The terminal: live progress from the worker's progress events, then a short summary."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from orchestrator.stream.events import Event
from orchestrator.tracking.status import STATUS_STYLE


class LiveProgress:
    """One bar per (scope, task) the worker reports; log lines and errors printed above the bars."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.fields[label]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._tasks: dict[tuple[str | None, str], Any] = {}

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._progress.stop()

    def show(self, event: Event) -> None:
        data = event.data if isinstance(event.data, dict) else {"message": event.data}
        if event.kind == "progress":
            key = (event.scope, str(data.get("task", "work")))
            label = f"{event.scope}/{key[1]}" if event.scope else key[1]
            if key not in self._tasks:
                self._tasks[key] = self._progress.add_task("", total=None, label=label)
            self._progress.update(
                self._tasks[key],
                completed=data.get("completed", 0),
                total=data.get("total"),
                description=str(data.get("message", "")),
            )
        elif event.kind == "start" and data.get("cuda_visible_devices"):
            self.console.print(f"worker pid {data.get('pid')} on GPU {escape(str(data['cuda_visible_devices']))}")
        elif event.kind == "log":  # the worker's text is never read as markup (`[/INST]`, `[batch, seq]`)
            self.console.print(f"[dim]worker:[/dim] {escape(str(data.get('message', '')))}")
        elif event.kind == "traceback":
            self.console.print(f"[red]worker error:[/red] {escape(str(data.get('error', '')))}")

    def note(self, message: str) -> None:
        self.console.print(message)


def summary_table(status: str, error: str | None, answers: dict[str, Any], links: dict[str, str]) -> Table:
    """Status, the worker's own summary lines, and where to find the run."""
    table = Table(title="Run summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_row("status", f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]")
    if error:
        table.add_row("error", error)
    for key, value in answers.items():
        table.add_row(key, str(value))
    for key, value in links.items():
        table.add_row(key, value)
    return table
