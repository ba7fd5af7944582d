"""Per-run stream state, saved after every applied batch so a new orchestrator process can resume."""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from orchestrator.config.handover import read_whole, write_whole


class LocalFailure(Exception):
    """Something on this machine failed (the state folder, the local disk): the message names the file or
    setting. Raised by the local state and mirror, given its meaning for the run in `lifecycle/errors.py`."""


@dataclass
class StreamState:
    run_id: str
    host: str
    run_dir: str
    last_seq: int = -1
    offset: int = 0
    children: dict[str, str] = field(default_factory=dict)


class StateStore:
    """One JSON file per run under `state_dir`, replaced atomically."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / "runs"
        self._locks: dict[str, int] = {}

    def path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.json"

    def mirror_path(self, run_id: str) -> Path:
        """The local copy of the run's events.jsonl (see `mirror.py`)."""
        return self.dir / f"{run_id}.events.jsonl"

    def check_writable(self) -> None:
        """Fail before anything is created if the state folder cannot hold a run's state."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise LocalFailure(f"orchestrator.state_dir {self.dir.parent}: {exc.strerror or exc}") from exc

    def save(self, state: StreamState) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_whole(self.path(state.run_id), json.dumps(asdict(state), indent=1))
        except OSError as exc:
            raise LocalFailure(f"orchestrator.state_dir {self.dir.parent}: {exc.strerror or exc}") from exc

    def lock(self, run_id: str) -> int | None:
        """Hold the run for this process (until it exits); None if it is held, else the lock's descriptor.

        Two processes of this machine following one run would both write its mirror and its state; the
        second one (an attach, a cancel) learns of the first instead. `holder` says who that is."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / f"{run_id}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise LocalFailure(f"orchestrator.state_dir {self.dir.parent}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._locks[run_id] = fd
        return fd

    def release(self, run_id: str) -> None:
        """Let go of the run (the process's end does as much)."""
        fd = self._locks.pop(run_id, None)
        if fd is not None:
            os.close(fd)

    def holder(self, run_id: str) -> str:
        """The pid written by the process that holds the run's lock, or `?`."""
        try:
            return (self.dir / f"{run_id}.lock").read_text().strip() or "?"
        except OSError:
            return "?"

    def load(self, run_id: str) -> StreamState | None:
        text = read_whole(self.path(run_id))
        return None if text is None else StreamState(**json.loads(text))
