"""The orchestrator's half of the event protocol: whole lines from a byte stream, parsed and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from remote_worker.events import EVENTS_FILE, KINDS

__all__ = [
    "EVENTS_FILE",
    "BadLine",
    "Event",
    "ProtocolError",
    "parse_chunk",
    "parse_event",
    "progress_text",
    "split_events",
]


class ProtocolError(RuntimeError):
    """The event log broke the protocol (bad JSON, unknown kind, a gap in `seq`)."""


HOST_SAMPLE_PREFIX = "system/"  # MLflow's system metrics: what the worker's host sampler sends


@dataclass(frozen=True)
class Event:
    seq: int
    t: float
    kind: str
    data: Any = field(default_factory=dict)
    scope: str | None = None
    step: int | None = None

    @property
    def timestamp_ms(self) -> int:
        return int(self.t * 1000)

    @property
    def host_sample(self) -> bool:
        """The worker's sample of its host (`remote_worker.host_load`: metrics under `system/` alone). It comes
        every few seconds whatever the work does, so it is no sign that the work goes on: the silence lines
        and `list`'s quiet column leave it out, or a hung decode would look busy."""
        data = self.data
        return (
            self.kind == "metrics"
            and isinstance(data, dict)
            and bool(data)
            and all(str(key).startswith(HOST_SAMPLE_PREFIX) for key in data)
        )


def progress_text(data: dict[str, Any]) -> str:
    """A progress event as one line, `ddtree_tb32 · prompt 3/8 · tau 4.53 · 12/40`: the run's `progress` tag
    and `list`'s progress column say it alike."""
    message = str(data.get("message") or data.get("task") or "")
    return f"{message} · {data.get('completed', '?')}/{data.get('total', '?')}"


def parse_event(line: bytes) -> Event:
    try:
        raw = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"event line is not JSON: {line[:200]!r}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError(f"event line is not a JSON object: {line[:200]!r}")
    try:
        seq, t, kind = raw["seq"], raw["t"], raw["kind"]
    except KeyError as exc:
        raise ProtocolError(f"event without {exc.args[0]!r}: {line[:200]!r}") from exc
    if not isinstance(seq, int) or seq < 0 or not isinstance(t, (int, float)) or kind not in KINDS:
        raise ProtocolError(f"malformed event: {line[:200]!r}")
    step = raw.get("step")
    return Event(seq=seq, t=float(t), kind=kind, data=raw.get("data", {}), scope=raw.get("scope"), step=step)


def split_events(chunk: bytes) -> tuple[list[Event], int]:
    """Parse the complete lines of `chunk`; return them and the number of bytes they span.

    A trailing line without its newline is still being written: it is left for the next read.
    """
    events, bad, end = parse_chunk(chunk, 0)
    if bad:
        raise ProtocolError(bad[0].reason)
    return events, end


@dataclass(frozen=True)
class BadLine:
    """A complete line of the log that is not an event: skipped, and reported with where it lies."""

    offset: int  # byte offset of the line's start in events.jsonl
    reason: str


def parse_chunk(chunk: bytes, base_offset: int) -> tuple[list[Event], list[BadLine], int]:
    """Like `split_events`, but a malformed line is set aside instead of stopping the stream.

    `base_offset` is where `chunk` starts in the log, so each bad line is reported at its own offset."""
    end = chunk.rfind(b"\n") + 1
    events: list[Event] = []
    bad: list[BadLine] = []
    position = 0
    for line in chunk[:end].split(b"\n")[:-1]:
        if line.strip():
            try:
                events.append(parse_event(line))
            except ProtocolError as exc:
                bad.append(BadLine(base_offset + position, str(exc)))
        position += len(line) + 1
    return events, bad, end
