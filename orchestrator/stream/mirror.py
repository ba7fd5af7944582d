"""A local, byte-exact copy of the worker's `events.jsonl`, so reading the worker never waits on MLflow.

Reading and applying are two cursors over the same bytes: the mirror's size is how far the host's log has
been read; the stream state's `offset` is how far MLflow has been told. While the tracking store is down
the first keeps moving and the second waits; when it comes back, the waiting events are applied from the
mirror, each exactly once (by `seq`). The mirror also answers "how did the worker end?" from the worker's
own `end` event, whoever applied it and whenever, because it always holds the log from its first byte.
A worker started again in the same run (a Slurm job requeued, `sweep/slurm.py`) appends to the same log:
its `start` begins a new attempt, and only the last attempt's `end` says how the run ended.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import time
from pathlib import Path

from orchestrator.host.transport import Transport
from orchestrator.stream.events import EVENTS_FILE, BadLine, Event, parse_chunk
from orchestrator.stream.state import LocalFailure
from remote_worker.safe_files import Folder, UnsafePath

READ_LIMIT = 4 * 1024 * 1024


class EventMirror:
    """The mirror lives in the state folder (`folder`, a `Folder` of the safe file layer, named `name`): it is
    opened without following a link, so a link planted at its name is refused, never written through."""

    def __init__(self, folder: Folder, name: str, run_dir: str) -> None:
        self.folder, self.name = folder, name
        self.path = Path(folder.root) / name
        self.host_path = posixpath.join(run_dir, EVENTS_FILE)
        try:
            fd = folder.open_update(name)
            self.size = os.fstat(fd).st_size
            os.close(fd)
        except (OSError, UnsafePath) as exc:
            raise LocalFailure(f"orchestrator.state_dir: cannot write {self.path}: {_why(exc)}") from exc
        self.end: Event | None = None
        self.bad: list[BadLine] = []
        self.last_growth = time.monotonic()
        self._scanned = 0
        self.scan()

    @classmethod
    def at(cls, path: Path, run_dir: str) -> EventMirror:
        """A mirror at the file `path` (its folder must exist)."""
        return cls(Folder(path.parent), path.name, run_dir)

    def pull(self, transport: Transport) -> int:
        """Copy what the worker appended since the last pull; return how many bytes came.

        The file is cut back to `size` before each append and `size` is read back from the file after it,
        so an append interrupted half-way (Ctrl-C, a full disk) is redone, never doubled: the mirror stays a
        byte-exact prefix of the host's log."""
        added = 0
        while True:
            chunk = transport.read_bytes(self.host_path, self.size, READ_LIMIT)
            if not chunk:
                break
            try:
                with os.fdopen(self.folder.open_update(self.name), "r+b") as f:
                    try:
                        f.truncate(self.size)
                        f.seek(self.size)
                        f.write(chunk)
                        f.flush()
                        os.fsync(f.fileno())
                    finally:
                        self.size = min(f.seek(0, os.SEEK_END), self.size + len(chunk))
            except (OSError, UnsafePath) as exc:  # never mistaken for the connection (OSError too)
                raise LocalFailure(f"orchestrator.state_dir: cannot write {self.path}: {_why(exc)}") from exc
            added += len(chunk)
            if len(chunk) < READ_LIMIT:
                break
        if added:
            self.last_growth = time.monotonic()
        return added

    def copy_to(self, local: Path) -> None:
        """The whole mirror, copied to `local` (for the run's `events.jsonl` artifact)."""
        try:
            self.folder.copy_to(self.name, local)
        except (OSError, UnsafePath) as exc:
            raise LocalFailure(f"orchestrator.state_dir: cannot read {self.path}: {_why(exc)}") from exc

    def remove(self) -> None:
        with contextlib.suppress(OSError, UnsafePath):
            self.folder.remove(self.name)

    def scan(self) -> tuple[list[Event], list[BadLine]]:
        """Parse the lines that became complete: note the last attempt's `end` event; return them and the
        malformed ones."""
        events, bad, consumed = parse_chunk(self._read(self._scanned), self._scanned)
        self._scanned += consumed
        for event in events:
            if event.kind == "start":  # a new attempt: an earlier attempt's end is not the run's
                self.end = None
            elif event.kind == "end" and self.end is None:
                self.end = event
        self.bad.extend(bad)
        return events, bad

    def events_after(self, offset: int, limit: int | None = None) -> tuple[list[Event], int]:
        """Complete events from byte `offset` on (at most `limit`), and the offset just past the last line read."""
        chunk = self._read(offset)
        end = chunk.rfind(b"\n") + 1
        if limit is not None:
            position = 0
            for _ in range(limit):
                newline = chunk.find(b"\n", position)
                if newline < 0:
                    break
                position = newline + 1
            end = min(end, position)
        events, _bad, consumed = parse_chunk(chunk[:end], offset)
        return events, offset + consumed

    def cursor_problem(self, offset: int, last_seq: int) -> str | None:
        """Why (`offset`, `last_seq`) is not a point this log was applied up to; None when it is: the offset
        lies within what was read, at a line's end, and the event before it has `last_seq`."""
        if offset < 0 or last_seq < -1:
            return "is negative"
        if offset > self.size:
            return f"lies past the end of the event log ({self.size} bytes read)"
        before = self._read(0)[:offset]
        if offset and not before.endswith(b"\n"):
            return "does not fall at the end of a line"
        events, _bad, _ = parse_chunk(before, 0)
        seq = events[-1].seq if events else -1
        if seq != last_seq:
            return f"names seq {last_seq}, but the event there is seq {seq}"
        return None

    def waiting(self, last_applied_seq: int, offset: int) -> int:
        """How many read events MLflow has not been told yet."""
        events, _ = self.events_after(offset)
        return sum(1 for event in events if event.seq > last_applied_seq)

    def _read(self, offset: int) -> bytes:
        try:
            return self.folder.read(self.name, offset, max(0, self.size - offset)) or b""
        except (OSError, UnsafePath) as exc:
            raise LocalFailure(f"orchestrator.state_dir: cannot read {self.path}: {_why(exc)}") from exc

    def seconds_silent(self) -> float:
        return time.monotonic() - self.last_growth


def _why(exc: OSError | UnsafePath) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
