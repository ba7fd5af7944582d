"""The terminal: live progress from the worker's progress events, then a short summary."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from orchestrator.stream.events import Event
from orchestrator.tracking.status import STATUS_STYLE

BAR_MIN, BAR_MAX = 10, 40
_LABEL, _BAR, _DESCRIPTION = 1, 2, 4  # the columns of a progress line that give way when it is too long


def fit_widths(width: int, fixed: int, label: int, description: int) -> tuple[int, int, int]:
    """The label's, the bar's and the description's widths on a line of `width` characters whose other
    columns (the count, the times, the gaps between columns) take `fixed`.

    Those others are never cut: a count cut to `32/…` or an ETA cut to `0:00:…` says nothing. The label keeps
    up to two fifths of the rest, the description what a bar of BAR_MIN leaves, the bar the remainder (at
    most BAR_MAX); a label or a description longer than its width ends in `…`."""
    room = max(width - fixed, 0)
    label_width = min(label, room * 2 // 5)
    room -= label_width
    description_width = min(description, max(room - BAR_MIN, 0))
    return label_width, max(min(BAR_MAX, room - description_width), 0), description_width


class _FittedProgress(Progress):
    """rich's Progress with its lines fitted to the terminal by `fit_widths`: left to itself, rich narrows
    every column alike and cuts the count and the ETA first."""

    def make_tasks_table(self, tasks: Iterable[Task]) -> Table:
        rows = [
            [column.format(task=task) if isinstance(column, str) else column(task) for column in self.columns]
            for task in tasks
            if task.visible
        ]
        if not rows:  # also while rich builds its first frame, before there is a console to ask
            return Table.grid()
        options = self.console.options
        widths = [
            max((Measurement.get(self.console, options, row[index]).maximum for row in rows), default=0)
            for index in range(len(self.columns))
        ]
        fixed = sum(w for i, w in enumerate(widths) if i not in (_LABEL, _BAR, _DESCRIPTION)) + len(widths) - 1
        label, bar, description = fit_widths(options.max_width, fixed, widths[_LABEL], widths[_DESCRIPTION])
        fitted = {_LABEL: label, _BAR: bar, _DESCRIPTION: description}
        table = Table.grid(padding=(0, 1))
        for index in range(len(self.columns)):
            table.add_column(no_wrap=True, overflow="ellipsis", width=fitted.get(index))
        for row in rows:
            table.add_row(*row)
        return table


class LiveProgress:
    """One bar per (scope, task) the worker reports; log lines and errors printed above the bars.

    Each line fits the terminal (see `fit_widths`); the worker's text is never read as markup."""

    def __init__(self, console: Console, clock: Callable[[], float] | None = None) -> None:
        self.console = console
        self._progress = _FittedProgress(
            SpinnerColumn(),
            TextColumn("{task.fields[label]}", style="bold", markup=False),
            BarColumn(bar_width=None),
            MofNCompleteColumn(),
            TextColumn("{task.description}", markup=False),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            get_time=clock,  # the elapsed time and the ETA's rate: a test's clock, else rich's monotonic one
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
