"""Follow a worker's event log by byte offset and hand each new event to the MLflow sink and the terminal."""

from __future__ import annotations

import contextlib
import posixpath
import time
from collections.abc import Callable

from orchestrator.events import EVENTS_FILE, Event, split_events
from orchestrator.launch import WorkerStatus, worker_status
from orchestrator.ssh_transport import CONNECTION_ERRORS
from orchestrator.tracking.sink import MlflowSink
from orchestrator.transport import Transport

READ_LIMIT = 4 * 1024 * 1024


def drain(transport: Transport, sink: MlflowSink, show: Callable[[Event], None]) -> bool:
    """Apply every complete event line written so far; True if there were any."""
    path = posixpath.join(sink.state.run_dir, EVENTS_FILE)
    any_new = False
    while True:
        chunk = transport.read_bytes(path, sink.state.offset, READ_LIMIT)
        events, consumed = split_events(chunk)
        if not consumed:
            return any_new
        for event in sink.apply(events, sink.state.offset + consumed):
            show(event)
        any_new = True


class HostUnreachable(RuntimeError):
    """The host could not be reached again within the reconnect budget."""


class _Reconnect:
    """Exponential backoff (0.5 s doubling to 8 s) within a budget that restarts after every success."""

    def __init__(self, transport: Transport, budget_s: float, note: Callable[[str], None]) -> None:
        self.transport, self.budget_s, self.note = transport, budget_s, note
        self.lost_since: float | None = None
        self.delay = 0.5

    def succeeded(self) -> None:
        if self.lost_since is not None:
            self.note(f"[green]reconnected to {self.transport.name}[/green]")
        self.lost_since, self.delay = None, 0.5

    def after(self, error: Exception) -> None:
        now = time.monotonic()
        if self.lost_since is None:
            self.lost_since = now
            self.note(f"[yellow]lost {self.transport.name} ({type(error).__name__}: {error}); reconnecting[/yellow]")
        waited = now - self.lost_since
        if waited >= self.budget_s:
            raise HostUnreachable(
                f"{self.transport.name} unreachable for {waited:.0f}s: {type(error).__name__}: {error}"
            )
        time.sleep(min(self.delay, max(self.budget_s - waited, 0.0)))
        self.delay = min(self.delay * 2, 8.0)
        with contextlib.suppress(*CONNECTION_ERRORS):  # the next attempt tells
            self.transport.reconnect()


def follow(
    transport: Transport,
    sink: MlflowSink,
    show: Callable[[Event], None],
    poll_interval_s: float,
    check_interrupt: Callable[[], None],
    reconnect_budget_s: float = 0.0,
    note: Callable[[str], None] = print,
) -> WorkerStatus | None:
    """Apply events until the worker's `end` event (returns None) or until it is gone (returns its status).

    A lost connection is re-opened with backoff and the log is read on from the saved offset, so nothing
    is lost or applied twice; past `reconnect_budget_s` without the host, HostUnreachable is raised.
    """
    reconnect = _Reconnect(transport, reconnect_budget_s, note)
    said_waiting = False
    while True:
        check_interrupt()
        try:
            if drain(transport, sink, show):
                reconnect.succeeded()
                if sink.end is not None:
                    return None
                time.sleep(poll_interval_s)
                continue  # events are flowing, so the worker is alive: no need to ask
            status = worker_status(transport, sink.state.run_dir)
            if status.state == "waiting" and not said_waiting:
                note(f"[yellow]every GPU of {transport.name} is leased; waiting for one to be free[/yellow]")
                said_waiting = True
            if not status.alive:
                # The last events may have landed between the read above and the status check.
                drain(transport, sink, show)
                return None if sink.end is not None else status
            reconnect.succeeded()
        except CONNECTION_ERRORS as error:
            reconnect.after(error)
            continue
        time.sleep(poll_interval_s)


def wait_for_exit(
    transport: Transport,
    run_dir: str,
    timeout_s: float,
    reconnect_budget_s: float = 0.0,
    note: Callable[[str], None] = print,
) -> WorkerStatus:
    """After `end`, the worker only has to close its files; give it `timeout_s` to be gone.

    The connection may still drop here (the end event was read, the status question was not answered):
    reconnect as while following, so a finished run is never turned FAILED by the network."""
    reconnect = _Reconnect(transport, reconnect_budget_s, note)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = worker_status(transport, run_dir)
        except CONNECTION_ERRORS as error:
            reconnect.after(error)
            continue
        reconnect.succeeded()
        if not status.alive or time.monotonic() > deadline:
            return status
        time.sleep(0.1)
