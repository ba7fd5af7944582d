"""This user's own state on this machine: per-run stream state, the runs launched from here, each run's lock.

The folder (`orchestrator.state_dir`) is the user's alone: created 0700 and checked before every command
(owned by the user, no group or other write bit, not a link; `safe_files.private_folder`), because what it
holds is believed: the stream's resume point, which run `last` means, which process follows a run. Every
file in it is read and written through the safe file layer, so a link planted at a lock, a state file or a
mirror is never followed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from remote_worker.safe_files import Folder, UnsafePath, private_folder

RUN_ID = re.compile(r"[0-9a-f]{32}")


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

    @classmethod
    def from_json(cls, raw: Any) -> StreamState | None:
        """From a state file's content; None when it is not one (a file of ours, but a half-finished disk)."""
        if not isinstance(raw, dict) or not {f.name for f in fields(cls)} >= set(raw):
            return None
        try:
            state = cls(**raw)
        except TypeError:
            return None
        typed = (
            isinstance(state.run_id, str)
            and isinstance(state.run_dir, str)
            and isinstance(state.last_seq, int)
            and isinstance(state.offset, int)
            and isinstance(state.children, dict)
        )
        return state if typed else None


@dataclass(frozen=True)
class Launched:
    """A run this user launched from this machine: what `last` chooses among (`cli/last.py`)."""

    run_id: str
    host: str
    workdir: str
    name: str  # the MLflow run's name
    started: float  # unix seconds
    session: int  # the launching shell's session (os.getsid): `last` prefers the runs of the shell it is in
    sweep_job: int | None = None  # a sweep's job number, or None for a run of its own


class StateStore:
    """One JSON file per run under `state_dir/runs/`, replaced whole; `state_dir/launched/` notes each run
    launched from here."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir)
        self.dir = self.root / "runs"
        self.files = Folder(self.dir)
        self._launched = Folder(self.root / "launched")
        self._locks: dict[str, int] = {}
        self._checked = False  # `check` (or a first write) made and checked the folders

    def path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.json"

    def mirror_name(self, run_id: str) -> str:
        """The local copy of the run's events.jsonl, in `self.files` (see `mirror.py`); the folders are made
        and checked first."""
        try:
            self._private()
        except (OSError, UnsafePath) as exc:
            raise self._failure(exc) from exc
        return f"{run_id}.events.jsonl"

    def _failure(self, exc: OSError | UnsafePath) -> LocalFailure:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return LocalFailure(f"orchestrator.state_dir {self.root}: {detail}")

    def check(self) -> None:
        """Before anything is created: the folder (and its parts) exist, are this user's alone, and can be
        written. Refused in one line otherwise, with the fix."""
        try:
            self._private()
            probe = f".probe-{os.getpid()}"
            self.files.write_whole(probe, b"ok")
            self.files.remove(probe)
        except UnsafePath as exc:
            raise LocalFailure(
                f"orchestrator.state_dir {self.root}: {exc}; only you may write the folder that says which run "
                f"is yours (`chmod 700 {self.root}`, or choose another with orchestrator.state_dir=...)"
            ) from exc
        except OSError as exc:
            raise self._failure(exc) from exc

    def _private(self) -> None:
        if not self._checked:
            for folder in (self.root, self.dir, self.root / "launched"):
                private_folder(folder)
            self._checked = True

    def save(self, state: StreamState) -> None:
        try:
            self._private()
            self.files.write_whole(f"{state.run_id}.json", json.dumps(asdict(state), indent=1).encode())
        except (OSError, UnsafePath) as exc:
            raise self._failure(exc) from exc

    def load(self, run_id: str) -> StreamState | None:
        try:
            text = self.files.read_text(f"{run_id}.json")
        except (OSError, UnsafePath) as exc:
            raise self._failure(exc) from exc
        if text is None:
            return None
        try:
            return StreamState.from_json(json.loads(text))
        except ValueError:
            return None

    def lock(self, run_id: str) -> int | None:
        """Hold the run for this process (until it exits); None if it is held, else the lock's descriptor.

        Two processes of this machine following one run would both write its mirror and its state; the
        second one (an attach, a cancel) learns of the first instead. `holder` says who that is."""
        try:
            self._private()
            fd = self.files.open_update(f"{run_id}.lock")
        except (OSError, UnsafePath) as exc:
            raise self._failure(exc) from exc
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
            text = self.files.read_text(f"{run_id}.lock")
        except (OSError, UnsafePath):
            return "?"
        pid = (text or "").strip()
        return pid if pid.isdigit() else "?"

    def remove(self, name: str) -> None:
        try:
            self.files.remove(name)
        except (OSError, UnsafePath) as exc:
            raise self._failure(exc) from exc

    # -- the runs launched from here ----------------------------------------------------------------------

    def note_launched(self, launched: Launched) -> None:
        try:
            self._private()
            self._launched.write_whole(f"{launched.run_id}.json", json.dumps(asdict(launched)).encode())
        except (OSError, UnsafePath) as exc:
            raise self._failure(exc) from exc

    def launched(self) -> list[Launched]:
        """Every run noted as launched from here, newest first (a record that does not parse is skipped)."""
        found = []
        try:
            names = sorted(os.listdir(self._launched.root))
        except FileNotFoundError:
            return []
        for name in names:
            if not (name.endswith(".json") and RUN_ID.fullmatch(name[:-5])):
                continue
            try:
                raw = json.loads(self._launched.read_text(name) or "null")
                record = Launched(**raw) if isinstance(raw, dict) else None
            except (OSError, UnsafePath, ValueError, TypeError):
                continue
            if record is not None and record.run_id == name[:-5]:
                found.append(record)
        return sorted(found, key=lambda r: r.started, reverse=True)
