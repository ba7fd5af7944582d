"""Follow a worker's event log by byte offset and hand each new event to the MLflow sink and the terminal."""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable

from orchestrator.events import EVENTS_FILE, Event, split_events
from orchestrator.launch import WorkerStatus, worker_status
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


def follow(
    transport: Transport,
    sink: MlflowSink,
    show: Callable[[Event], None],
    poll_interval_s: float,
    check_interrupt: Callable[[], None],
) -> WorkerStatus | None:
    """Apply events until the worker's `end` event (returns None) or until it is gone (returns its status)."""
    while True:
        check_interrupt()
        if drain(transport, sink, show) and sink.end is not None:
            return None
        status = worker_status(transport, sink.state.run_dir)
        if not status.alive:
            # The last events may have landed between the read above and the status check.
            drain(transport, sink, show)
            return None if sink.end is not None else status
        time.sleep(poll_interval_s)


def wait_for_exit(transport: Transport, run_dir: str, timeout_s: float) -> WorkerStatus:
    """After `end`, the worker only has to close its files; give it `timeout_s` to be gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = worker_status(transport, run_dir)
        if not status.alive or time.monotonic() > deadline:
            return status
        time.sleep(0.1)
