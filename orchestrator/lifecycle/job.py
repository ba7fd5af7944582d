"""One job as the commands hold it: what it has open, filled in phase by phase, and the few helpers every
phase shares (the host's files fetched for it, its interpreter).

The phases are in `phases.py`, what the end collects and records in `collect.py`, how a worker is stopped in
`stopping.py`, and `outcomes.lifecycle` is the one place that gives every failure its meaning. The commands
in `cli/` (run, detach, attach, cancel) are the same recipe with a different body.
"""

from __future__ import annotations

import posixpath
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.markup import escape

from orchestrator.config.settings import JobConfig
from orchestrator.host.transport import CONNECTION_ERRORS, Transport, UnsafePath
from orchestrator.lifecycle.display import LiveProgress
from orchestrator.lifecycle.follow import Applier
from orchestrator.stream.mirror import EventMirror
from orchestrator.stream.sink import MlflowSink
from orchestrator.stream.state import StateStore, StreamState
from orchestrator.sweep import Sweep
from orchestrator.tracking import tags
from orchestrator.tracking.signing import KeyUnavailable, phase_1_signature, signing_key
from remote_worker.decoding.two_phase import PHASE_1_FILE

STDERR_TAIL_LINES = 20
CANCEL_REQUEST_FILE = "cancel_requested"  # left in the run folder by `cancel` before it stops the worker
CANCELLED_BY_USER = "cancelled by the user"
GENERATIONS_FILE = "generations.jsonl"  # written by experiment=ddtree_gdn, one row per prompt
GENERATIONS_TABLE = "generations_table.json"


@dataclass
class Job:
    """Everything one job holds open, filled in phase by phase."""

    config: JobConfig
    console: Console
    live: LiveProgress
    client: MlflowClient
    store: StateStore
    transport: Transport
    experiment_id: str
    state: StreamState
    check_interrupt: Callable[[], None]
    stopping: Callable[[], None] = lambda: None  # from now on Ctrl-C must not interrupt the clean-up
    sweep: Sweep | None = None
    started_s_ago: float = 0.0  # attach: how long ago the run began (for the start deadline)
    stop_grace_s: float | None = None  # SIGTERM to SIGKILL in a stop; None: orchestrator.kill_grace_s
    launched: bool = False  # a worker may be running: every failure from here on stops it
    tracking_down: bool = False  # the last call to MLflow found it unreachable
    interrupted: bool = False  # Ctrl-C or a cancel: nothing waits any more
    found_ended: bool = False  # cancel: the worker had ended before the cancel came (its end is only recorded)
    stderr_tail: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    handed_phase_1: bytes | None = None  # an earlier run's phase 1 the worker goes on from (`sweep/resume.py`)
    _mirror: EventMirror | None = None
    _sink: MlflowSink | None = None
    _applier: Applier | None = None

    @property
    def mirror(self) -> EventMirror:
        if self._mirror is None:
            self._mirror = EventMirror(self.store.files, self.store.mirror_name(self.state.run_id), self.state.run_dir)
        return self._mirror

    @property
    def sink(self) -> MlflowSink:
        if self._sink is None:
            self._sink = MlflowSink(
                self.client, self.experiment_id, self.state, self.store, self.transport, self._file_tags
            )
        return self._sink

    def _file_tags(self, relative: str, local: Path) -> dict[str, str]:
        """A two-phase job's phase 1, signed as it is received (`tracking/signing.py`): a sweep run again after
        this job stopped in phase 2 goes on from it."""
        if relative != PHASE_1_FILE:
            return {}
        try:
            key = signing_key(Path(self.config.orchestrator.state_dir))
        except KeyUnavailable as exc:
            self.live.note(f"[yellow]phase 1 not signed (a sweep run again decodes it again): {escape(str(exc))}[/]")
            return {}
        digest = self.client.get_run(self.state.run_id).data.tags.get(tags.CONFIG_HASH, "")
        return {tags.PHASE_1_SIGNATURE: phase_1_signature(key, self.state.run_id, digest, local.read_bytes())}

    @property
    def applier(self) -> Applier:
        if self._applier is None:
            self._applier = Applier(self.sink, self.mirror, self.live.note)
        return self._applier

    @property
    def host_label(self) -> str:
        return self.config.host.name


def worker_python(job: Job) -> str:
    """The host's interpreter for the worker (on this machine, by default, this one)."""
    return job.config.host.python or sys.executable


def fetch(job: Job, name: str, local: Path) -> bool:
    """The run folder's file `name` copied to `local`; False (with a line) where it cannot be, or may not be."""
    try:
        return job.transport.fetch(posixpath.join(job.state.run_dir, name), local)
    except CONNECTION_ERRORS as exc:
        job.live.note(f"[yellow]could not fetch {name} from {job.host_label}: {exc}[/yellow]")
        return False
    except UnsafePath as exc:  # a link or a special file where the run's file should be: never uploaded
        job.live.note(f"[yellow]{name} not logged: {escape(str(exc))}[/yellow]")
        return False


def host_text(job: Job, name: str) -> str:
    """The run folder's text file `name`, or empty."""
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / name
        return local.read_text(encoding="utf-8", errors="replace") if fetch(job, name, local) else ""


def quietly(call: Callable[[], str | None]) -> str | None:
    """A diagnosis's answer, or None where asking fails."""
    try:
        return call()
    except Exception:  # noqa: BLE001 - a diagnosis that fails adds nothing and must not hide the failure
        return None
