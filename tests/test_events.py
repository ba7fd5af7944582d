"""The event log: written whole, in order, with gap-free seq; read back by byte offset in any chunking."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.stream.events import ProtocolError, parse_event, split_events
from remote_worker.events import EVENTS_FILE, EventLog


def write_log(run_dir: Path, n: int) -> bytes:
    log = EventLog(run_dir)
    log.emit("start", {"pid": 1})
    for i in range(n):
        log.emit("metrics", {"loss": 1.0 / (i + 1)}, step=i, scope="ar" if i % 2 else None)
    log.emit("end", {"status": "FINISHED"})
    log.close()
    return (run_dir / EVENTS_FILE).read_bytes()


def test_seq_is_gap_free_and_in_file_order(tmp_path: Path) -> None:
    raw = write_log(tmp_path, 5)
    events, consumed = split_events(raw)
    assert consumed == len(raw)
    assert [e.seq for e in events] == list(range(7))
    assert [e.kind for e in events] == ["start", *["metrics"] * 5, "end"]
    assert [e.step for e in events[1:-1]] == list(range(5))
    assert events[2].scope == "ar" and events[1].scope is None
    assert all(a.t <= b.t for a, b in pairwise(events))


def test_reopened_log_continues_seq(tmp_path: Path) -> None:
    write_log(tmp_path, 2)
    log = EventLog(tmp_path)
    assert log.emit("log", {"message": "again"}) == 4
    log.close()
    events, _ = split_events((tmp_path / EVENTS_FILE).read_bytes())
    assert [e.seq for e in events] == list(range(5))


def test_partial_last_line_is_left_for_the_next_read(tmp_path: Path) -> None:
    raw = write_log(tmp_path, 1)
    cut = len(raw) - 5
    events, consumed = split_events(raw[:cut])
    assert consumed < cut and raw[consumed - 1 : consumed] == b"\n"
    rest, rest_consumed = split_events(raw[consumed:])
    assert [e.seq for e in events + rest] == [0, 1, 2]
    assert consumed + rest_consumed == len(raw)


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_chunking_reads_the_same_events(tmp_path_factory: pytest.TempPathFactory, cuts: list[int]) -> None:
    raw = write_log(tmp_path_factory.mktemp("log"), 8)
    whole, _ = split_events(raw)
    offset, read = 0, []
    for cut in [*sorted(c % (len(raw) + 1) for c in cuts), len(raw)]:
        if cut <= offset:
            continue
        events, consumed = split_events(raw[offset:cut])
        read += events
        offset += consumed
    assert read == whole


def test_non_finite_numbers_stay_strict_json(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.emit("metrics", {"a": float("nan"), "b": float("inf")})
    log.close()
    line = (tmp_path / EVENTS_FILE).read_text().strip()
    assert json.loads(line)["data"] == {"a": "nan", "b": "inf"}


def test_unknown_kind_is_refused_by_both_sides(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        EventLog(tmp_path).emit("oops", {})
    with pytest.raises(ProtocolError):
        parse_event(b'{"seq": 0, "t": 1.0, "kind": "oops"}')


@pytest.mark.parametrize(
    "line", [b"not json", b"[1, 2]", b'{"seq": 0, "kind": "log"}', b'{"seq": -1, "t": 1, "kind": "log"}']
)
def test_malformed_lines_raise_protocol_error(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_event(line)
