"""Per-run stream state, saved after every applied batch so a new orchestrator process can resume."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


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

    def save(self, state: StreamState) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path(state.run_id).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=1), encoding="utf-8")
        os.replace(tmp, self.path(state.run_id))

    def load(self, run_id: str) -> StreamState | None:
        path = self.path(run_id)
        if not path.exists():
            return None
        return StreamState(**json.loads(path.read_text(encoding="utf-8")))
