"""The worker's half of the event protocol: an append-only JSON-lines log with gap-free `seq`.

Each event is written as one line and flushed before `emit` returns, so a reader that tails the file by
byte offset sees either a whole event or nothing of it.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from remote_worker.safe_files import Folder

EVENTS_FILE = "events.jsonl"
KINDS = frozenset({"start", "env", "params", "tags", "metrics", "progress", "log", "artifact", "traceback", "end"})


def _jsonable(value: Any) -> Any:
    """JSON has no NaN/Infinity; send them as strings so every line stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class EventLog:
    """Appends events to `<run_dir>/events.jsonl`, continuing the `seq` of an existing log."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        folder = Folder(run_dir)  # the log is appended to in place: never through a link planted at its name
        self._next_seq = self._count_existing(folder)
        self._file = os.fdopen(folder.open_append(EVENTS_FILE), "a", encoding="utf-8")
        self._lock = threading.RLock()

    @staticmethod
    def _count_existing(folder: Folder) -> int:
        data = folder.read(EVENTS_FILE)
        return 0 if data is None else data.count(b"\n")

    def emit(
        self,
        kind: str,
        data: Any = None,
        *,
        scope: str | None = None,
        step: int | None = None,
        t: float | None = None,
    ) -> int:
        """Write one event and return its `seq` (thread-safe: a library may log from its own thread)."""
        with self._lock:
            return self._emit(kind, data, scope=scope, step=step, t=t)

    def _emit(self, kind: str, data: Any, *, scope: str | None, step: int | None, t: float | None) -> int:
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {sorted(KINDS)}")
        event: dict[str, Any] = {"seq": self._next_seq, "t": time.time() if t is None else t, "kind": kind}
        if scope is not None:
            event["scope"] = scope
        if step is not None:
            event["step"] = int(step)
        event["data"] = _jsonable(data if data is not None else {})
        self._file.write(json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()
        self._next_seq += 1
        return event["seq"]

    def progress(self, task: str, completed: int, total: int, message: str = "") -> int:
        return self.emit("progress", {"task": task, "completed": completed, "total": total, "message": message})

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
