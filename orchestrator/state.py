"""Per-run stream state, saved after every applied batch so a new orchestrator process can resume."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from orchestrator.errors import LocalFailure


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
            tmp = self.path(state.run_id).with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(state), indent=1), encoding="utf-8")
            os.replace(tmp, self.path(state.run_id))
        except OSError as exc:
            raise LocalFailure(f"orchestrator.state_dir {self.dir.parent}: {exc.strerror or exc}") from exc

    def load(self, run_id: str) -> StreamState | None:
        path = self.path(run_id)
        if not path.exists():
            return None
        return StreamState(**json.loads(path.read_text(encoding="utf-8")))
