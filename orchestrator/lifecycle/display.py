"""The terminal: live progress from the worker's progress events, then a short summary."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.cells import cell_len, set_cell_size
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from orchestrator.config.text import printable
from orchestrator.stream.events import Event
from orchestrator.tracking.status import STATUS_STYLE

BAR_MIN, BAR_MAX = 10, 40
PERCENT_FROM = 1000  # a total this large is shown as a percent
BAR_LEAST = 4  # a bar narrower than this says nothing: its room goes to the description
SEPARATOR = " · "  # between the figures of a worker's progress message
_LABEL, _BAR, _DESCRIPTION = 1, 2, 4  # the columns of a progress line that give way when it is too long


def fit_widths(width: int, fixed: int, label: int, description: int) -> tuple[int, int, int]:
    """The label's, the bar's and the description's widths on a line of `width` characters whose other
    columns (the count, the times, the gaps between columns) take `fixed`; a bar of 0 is left out, and its
    gap goes to the description.

    Those others are never cut: a count cut to `32/…` or an ETA cut to `0:00:…` says nothing. The label keeps
    up to two fifths of the rest; then the description's figures come before the bar, which takes what they
    leave (at most BAR_MAX; left out under BAR_LEAST)."""
    room = max(width - fixed, 0)
    label_width = min(label, room * 2 // 5)
    room -= label_width
    if description + BAR_MIN <= room:
        return label_width, min(BAR_MAX, room - description), description
    if room - description >= BAR_LEAST:
        return label_width, room - description, description
    return label_width, 0, min(description, room + 1)


def fit_message(text: str, width: int) -> str:
    """`text` in `width` characters, cut between its figures (`a · b · c` → `a · b`), never inside one; a
    first figure longer than `width` alone ends in `…`."""
    if cell_len(text) <= width:
        return text
    parts = text.split(SEPARATOR)
    while len(parts) > 1 and cell_len(SEPARATOR.join(parts)) > width:
        parts.pop()
    kept = SEPARATOR.join(parts)
    return kept if cell_len(kept) <= width else set_cell_size(kept, max(width - 1, 0)) + "…" * (width > 0)


class _CountColumn(MofNCompleteColumn):
    """`12/40` where the count is a count of things (prompts, methods); a percent where the total is a
    measure of work in the thousands (node-rounds), whose digits say nothing and took the message's room."""

    def render(self, task: Task) -> Text:
        if task.total is not None and task.total >= PERCENT_FROM:
            return Text(f"{int(100 * task.completed // task.total)}%", style="progress.download")
        return super().render(task)


class _FittedProgress(Progress):
    """rich's Progress with its lines fitted to the terminal by `fit_widths`: left to itself, rich narrows
    every column alike and cuts the count and the ETA first."""

    def make_tasks_table(self, tasks: Iterable[Task]) -> Table:
        visible = [task for task in tasks if task.visible]
        rows = [
            [column.format(task=task) if isinstance(column, str) else column(task) for column in self.columns]
            for task in visible
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
        shown = [index for index in range(len(self.columns)) if not (index == _BAR and bar == 0)]
        table = Table.grid(padding=(0, 1))
        for index in shown:
            table.add_column(no_wrap=True, overflow="ellipsis", width=fitted.get(index))
        for task, row in zip(visible, rows, strict=True):
            row[_DESCRIPTION] = Text(fit_message(task.description, description))
            table.add_row(*(row[index] for index in shown))
        return table


class _EtaColumn(ProgressColumn):
    """The time left, from the task's rate since it was first seen (rich's own takes the last 30 s: a decode
    whose methods alternate fast and slow swung by minutes, and a prompt longer than 30 s froze it), counted
    down between the worker's reports (`eta_at`, set by `LiveProgress.show`)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self.clock = clock

    def render(self, task: Task) -> Text:
        eta_at = task.fields.get("eta_at")
        if eta_at is None:
            return Text("-:--:--", style="progress.remaining")
        left = max(0, round(eta_at - self.clock()))
        return Text(f"{left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}", style="progress.remaining")


class LiveProgress:
    """One bar per (scope, task) the worker reports; log lines and errors printed above the bars.

    Each line fits the terminal (see `fit_widths`); the worker's text is never read as markup."""

    def __init__(self, console: Console, clock: Callable[[], float] | None = None) -> None:
        self.console = console
        self.clock = clock or time.monotonic
        self._progress = _FittedProgress(
            SpinnerColumn(),
            TextColumn("{task.fields[label]}", style="bold", markup=False),
            BarColumn(bar_width=None),
            _CountColumn(),
            TextColumn("{task.description}", markup=False),
            TimeElapsedColumn(),
            TextColumn("eta"),
            _EtaColumn(self.clock),
            console=console,
            transient=False,
            get_time=clock,  # the elapsed time and the ETA's rate: a test's clock, else rich's monotonic one
        )
        self._tasks: dict[tuple[str | None, str], Any] = {}
        self._first_seen: dict[tuple[str | None, str], tuple[float, float]] = {}  # (time, completed) at first sight

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._progress.stop()

    def show(self, event: Event) -> None:
        data = event.data if isinstance(event.data, dict) else {"message": event.data}
        if event.kind == "progress":
            key = (event.scope, str(data.get("task", "work")))
            # A method's decode is labelled by its method alone; its message leads with it too: said once.
            label = (event.scope if key[1] == "decode" else f"{event.scope}/{key[1]}") if event.scope else key[1]
            label = printable(label)
            message = printable(data.get("message", ""))
            if event.scope and message.startswith(event.scope + SEPARATOR):
                message = message[len(event.scope + SEPARATOR) :]
            if key not in self._tasks:
                self._tasks[key] = self._progress.add_task("", total=None, label=label)
            completed, total = data.get("completed", 0), data.get("total")
            self._progress.update(
                self._tasks[key], completed=completed, total=total, description=message,
                eta_at=self._eta_at(key, completed, total),
            )  # fmt: skip
        elif event.kind == "start" and data.get("cuda_visible_devices"):
            gpu = escape(printable(data["cuda_visible_devices"]))
            self.console.print(f"worker pid {escape(printable(data.get('pid')))} on GPU {gpu}")
        elif event.kind == "log":  # the worker's text is never read as markup (`[/INST]`, `[batch, seq]`)
            self.console.print(f"[dim]worker:[/dim] {escape(printable(data.get('message', '')))}")
        elif event.kind == "traceback":
            self.console.print(f"[red]worker error:[/red] {escape(printable(data.get('error', '')))}")

    def _eta_at(self, key: tuple[str | None, str], completed: object, total: object) -> float | None:
        """When the task should end at its rate since first seen (None until it has moved)."""
        now = self.clock()
        if not isinstance(completed, (int, float)) or not isinstance(total, (int, float)):
            return None
        since, start = self._first_seen.setdefault(key, (now, float(completed)))
        if completed >= total:
            return now
        rate = (completed - start) / (now - since) if now > since else 0.0
        return now + (total - completed) / rate if rate > 0 else None

    def note(self, message: str) -> None:
        self.console.print(message)


def summary_table(status: str, error: str | None, answers: dict[str, Any], links: dict[str, str]) -> Table:
    """Status, the worker's own summary lines, and where to find the run."""
    table = Table(title="Run summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_row("status", f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]")
    if error:
        table.add_row("error", Text(printable(error)))
    for key, value in answers.items():  # the worker's own lines: text, never markup, control characters escaped
        table.add_row(Text(printable(key)), Text(printable(value)))
    for key, value in links.items():
        table.add_row(key, value)
    return table
