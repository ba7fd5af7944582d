"""Follow a running worker: copy its event log, apply it to MLflow, show it, and say when nothing moves.

Two things may be out of reach while the worker runs, and neither stops it:
- the host: the connection is opened again with backoff, and the log is read on from the mirror's size;
  past `host.reconnect_budget_s` the run is left for `attach` (HostLost).
- the tracking store: events keep being read into the mirror and shown; the terminal says once that
  MLflow is unreachable and how many events wait; they are applied, each once, when it answers again.

The loop ends when the worker is gone (its supervisor wrote `exit_code`, or its process group vanished),
after its last bytes are read. How it ended is decided later, from what the worker recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.host.launch import stop_worker
from orchestrator.host.run_folder import WorkerStatus, worker_status
from orchestrator.host.transport import CONNECTION_ERRORS, HostKeyRefused, Transport
from orchestrator.lifecycle.display import LiveProgress
from orchestrator.lifecycle.errors import HostLost, PhaseFailed
from orchestrator.stream.mirror import EventMirror
from orchestrator.stream.sink import MlflowSink
from orchestrator.tracking.client import TrackingUnavailable, outages_named, short_reason
from orchestrator.tracking.status import Stage
from remote_worker.wording import counted


class Reconnect:
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
        if isinstance(error, HostKeyRefused):  # a command reopened the connection itself and met a changed key
            raise HostLost(f"{self.transport.name}: {error}") from error
        now = time.monotonic()
        if self.lost_since is None:
            self.lost_since = now
            self.note(f"[yellow]lost {self.transport.name} ({type(error).__name__}: {error}); reconnecting[/yellow]")
        waited = now - self.lost_since
        if waited >= self.budget_s:
            raise HostLost(f"{self.transport.name} unreachable for {waited:.0f}s: {type(error).__name__}: {error}")
        time.sleep(min(self.delay, max(self.budget_s - waited, 0.0)))
        self.delay = min(self.delay * 2, 8.0)
        try:
            self.transport.reconnect()
        except HostKeyRefused as refused:  # not a network blip: waiting would not change the key
            raise HostLost(f"{self.transport.name}: {refused}") from refused
        except CONNECTION_ERRORS:
            pass  # the next attempt tells


class Applier:
    """Applies the mirror's unapplied events to MLflow; while the store is down, waits and says so once."""

    RETRY_MIN_S, RETRY_MAX_S = 1.0, 15.0
    CHUNK = 2000  # events per transaction

    def __init__(self, sink: MlflowSink, mirror: EventMirror, note: Callable[[str], None]) -> None:
        self.sink, self.mirror, self.note = sink, mirror, note
        self.down_since: float | None = None  # wall time, for the message
        self._next_try = 0.0
        self._delay = self.RETRY_MIN_S

    def _send_recent_log(self) -> None:
        try:
            self.sink.send_recent_log()
        except TrackingUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - a live extra; the events themselves are in
            self.note(f"[yellow]worker_log.txt not updated: {type(exc).__name__}: {short_reason(exc)}[/yellow]")

    @property
    def waiting(self) -> int:
        return self.mirror.waiting(self.sink.state.last_seq, self.sink.state.offset)

    def apply(self, *, now: bool = False) -> bool:
        """Apply what is waiting; True when nothing is left waiting. `now`: ignore the retry backoff."""
        if self.down_since is not None and not now and time.monotonic() < self._next_try:
            return False
        events, end_offset = self.mirror.events_after(self.sink.state.offset)
        self.sink.record_warnings(
            [f"malformed line at byte {bad.offset} skipped: {bad.reason}" for bad in self.mirror.bad]
        )
        try:
            with outages_named():
                self.sink.apply(events, end_offset)
        except TrackingUnavailable as exc:
            if self.down_since is None:
                self.down_since = time.time()
                self.note(
                    f"[yellow]MLflow unreachable since {time.strftime('%H:%M:%S', time.localtime(self.down_since))}"
                    f" ({exc}); {counted(self.waiting, 'event')} waiting. The worker goes on; nothing is lost.[/yellow]"
                )
            self._next_try = time.monotonic() + self._delay
            self._delay = min(self._delay * 2, self.RETRY_MAX_S)
            return False
        if self.down_since is not None:
            self.note(f"[green]MLflow answers again after {time.time() - self.down_since:.0f}s; events applied[/green]")
            self.down_since, self._delay = None, self.RETRY_MIN_S
        return True


@dataclass(frozen=True)
class FollowSettings:
    poll_interval_s: float
    reconnect_budget_s: float
    start_timeout_s: float
    stall_warning_s: float  # the first "no event" line; the next ones come after twice the silence (see Silence)
    exit_grace_s: float  # after `end`, how long the worker may take to close its files


class Silence:
    """When to say that a live worker writes nothing: first after `first_s` (so a user who sees no progress
    is told within a minute that the worker is alive), then each time the silence has doubled, at most
    MAX_GAP_S apart (a 27B checkpoint may load for many minutes: a line every poll would bury the rest)."""

    MAX_GAP_S = 15 * 60.0

    def __init__(self, first_s: float, now: float) -> None:
        self.first_s = first_s
        self.heard(now)

    def heard(self, now: float) -> None:
        """The worker wrote something: the silence, and its schedule, start again."""
        self.since, self.next_s = now, self.first_s

    def due(self, now: float) -> float | None:
        """How long the worker has been silent, when that is worth a line now; else None."""
        silent = now - self.since
        if silent < self.next_s:
            return None
        while self.next_s <= silent:
            self.next_s += min(max(self.next_s, 1e-3), self.MAX_GAP_S)
        return silent


class Follower:
    def __init__(
        self,
        transport: Transport,
        run_dir: str,
        mirror: EventMirror,
        applier: Applier,
        live: LiveProgress,
        settings: FollowSettings,
        check_interrupt: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport, self.run_dir, self.mirror, self.applier = transport, run_dir, mirror, applier
        self.live, self.settings, self.check_interrupt = live, settings, check_interrupt
        self.reconnect = Reconnect(transport, settings.reconnect_budget_s, live.note)
        self.clock = clock
        self._started_at = clock()
        self._said_waiting = False
        self._silence = Silence(settings.stall_warning_s, self._started_at)

    def pull(self) -> bool:
        """Copy new bytes from the host, show the new events; connection errors propagate. True when the worker
        said something other than its host's load (`Event.host_sample`, which comes whatever the work does: a
        hung decode's samples must not hide its silence, nor spare it the status check)."""
        added = self.mirror.pull(self.transport)
        events, bad = self.mirror.scan()
        for line in bad:
            self.live.note(f"[yellow]event log: malformed line at byte {line.offset} skipped ({line.reason})[/yellow]")
        for event in events:
            self.live.show(event)
        news = bool(bad) or any(not event.host_sample for event in events)
        if news:
            self._silence.heard(self.clock())
        return bool(added) and news

    def run(self) -> WorkerStatus:
        """Follow until the worker is gone; return its final status (every byte it wrote is mirrored)."""
        while True:
            self.check_interrupt()
            try:
                added = self.pull()
                status = None if added else worker_status(self.transport, self.run_dir)
                self.applier.apply()
                self.reconnect.succeeded()
            except CONNECTION_ERRORS as error:
                self.reconnect.after(error)
                continue
            if self.mirror.end is not None:
                return self._after_end()
            if status is not None:
                if not status.alive:
                    return self._final(status)
                self._watch(status)
            time.sleep(self.settings.poll_interval_s)

    def _final(self, status: WorkerStatus) -> WorkerStatus:
        """The worker is gone: its last lines may have landed between the read and the status."""
        self._retrying(self.pull)
        return status

    def _after_end(self) -> WorkerStatus:
        """`end` is recorded: the worker only closes its files now. Give it the grace, then make sure."""
        deadline = time.monotonic() + self.settings.exit_grace_s
        while True:
            status = self._retrying(lambda: worker_status(self.transport, self.run_dir))
            if not status.alive:
                break
            if time.monotonic() > deadline:
                status = self._retrying(lambda: stop_worker(self.transport, self.run_dir, self.settings.exit_grace_s))
                break
            time.sleep(0.1)
        self._retrying(self.pull)
        return status

    def _retrying(self, call: Callable[[], object]) -> object:
        while True:
            try:
                result = call()
            except CONNECTION_ERRORS as error:
                self.reconnect.after(error)
                continue
            self.reconnect.succeeded()
            return result

    def _watch(self, status: WorkerStatus) -> None:
        """No wait without a word: a worker that never starts, waits for a GPU, or falls silent."""
        if status.state == "starting" and self.clock() - self._started_at > self.settings.start_timeout_s:
            raise PhaseFailed(
                Stage.LAUNCH,
                f"the worker never started: no pid file in {self.run_dir} after "
                f"{self.settings.start_timeout_s:g}s (orchestrator.start_timeout_s)",
            )
        if status.state == "waiting":  # said once; not a silence either: the worker has not begun
            if not self._said_waiting:
                self.live.note(f"[yellow]every GPU of {self.transport.name} is leased; waiting for one to be free[/]")
                self._said_waiting = True
            self._silence.heard(self.clock())
        silent = self._silence.due(self.clock()) if status.state == "running" else None
        if silent is not None:
            self.live.note(
                f"[yellow]no event from the worker for {_duration(silent)}; it is alive (pid {status.pid})[/yellow]"
            )


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
