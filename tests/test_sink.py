"""The MLflow sink: every event applied exactly once, in order; re-applying a log changes nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.host.local import LocalTransport
from orchestrator.stream.events import split_events
from orchestrator.stream.sink import LAST_SEQ_TAG, OFFSET_TAG, MlflowSink
from orchestrator.stream.state import StateStore, StreamState
from orchestrator.tracking.tags import EVENT_LOG_WARNINGS
from remote_worker.events import EVENTS_FILE, EventLog


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[MlflowClient, str]:
    root = tmp_path_factory.mktemp("mlflow")
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment_id = client.create_experiment("sink", artifact_location=(root / "artifacts").as_uri())
    return client, experiment_id


def worker_log(run_dir: Path, rounds: int = 30) -> bytes:
    """A log shaped like a decode job: params, metrics per round in two scopes, an artifact, an end."""
    (run_dir / "probe.json").write_text('{"ok": true}')
    log = EventLog(run_dir)
    log.emit("start", {"pid": 123})
    log.emit("env", {"remote.torch": "2.13.0", "remote.HF_TOKEN": "hf_leak"})
    log.emit("params", {"probe.model.class": "Qwen3_5ForCausalLM", "auth_token": "leak"})
    for scope in ("ar", "ddtree_tb32"):
        log.emit("params", {"method": scope}, scope=scope)
        for step in range(rounds):
            log.emit("metrics", {"acceptance_length": float(step % 5 + 1)}, scope=scope, step=step)
        log.emit("metrics", {"tau": 2.5, "lossless": 1.0}, scope=scope, step=0)
    log.emit("progress", {"task": "decode", "completed": 1, "total": 1})
    log.emit("artifact", {"path": "probe.json"})
    log.emit("end", {"status": "FINISHED"})
    log.close()
    return (run_dir / EVENTS_FILE).read_bytes()


def new_sink(client: MlflowClient, experiment_id: str, run_id: str, run_dir: Path, state_dir: Path) -> MlflowSink:
    states = StateStore(state_dir)
    state = states.load(run_id) or StreamState(run_id=run_id, host="local", run_dir=str(run_dir))
    return MlflowSink(client, experiment_id, state, states, LocalTransport())


def snapshot(client: MlflowClient, run_ids: list[str]) -> dict:
    """Everything the sink can change, in a comparable form."""
    view = {}
    for run_id in run_ids:
        run = client.get_run(run_id)
        histories = {
            key: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))
            for key in run.data.metrics
        }
        artifacts = sorted(a.path for a in client.list_artifacts(run_id))
        tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
        view[run_id] = (run.data.params, tags, histories, artifacts)
    return view


@pytest.fixture
def job(store: tuple[MlflowClient, str], tmp_path: Path):
    client, experiment_id = store
    run_id = client.create_run(experiment_id).info.run_id
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    raw = worker_log(run_dir)
    return client, experiment_id, run_id, run_dir, raw, tmp_path / "state"


def test_log_lands_in_the_run_and_its_children(job) -> None:
    client, experiment_id, run_id, run_dir, raw, state_dir = job
    sink = new_sink(client, experiment_id, run_id, run_dir, state_dir)
    events, consumed = split_events(raw)
    assert len(sink.apply(events, consumed)) == len(events)
    assert sink.end == {"status": "FINISHED"}
    run = client.get_run(run_id)
    assert run.data.params["probe.model.class"] == "Qwen3_5ForCausalLM"
    assert run.data.params["auth_token"] == "***"
    assert run.data.tags["remote.torch"] == "2.13.0"
    assert run.data.tags["remote.HF_TOKEN"] == "***"
    assert run.data.tags[LAST_SEQ_TAG] == str(len(events) - 1)
    assert run.data.tags[OFFSET_TAG] == str(len(raw))
    assert [a.path for a in client.list_artifacts(run_id)] == ["probe.json"]
    assert set(sink.state.children) == {"ar", "ddtree_tb32"}
    for scope, child_id in sink.state.children.items():
        child = client.get_run(child_id)
        assert child.data.tags["mlflow.parentRunId"] == run_id
        assert child.data.params == {"method": scope}
        history = client.get_metric_history(child_id, "acceptance_length")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(30))
    saved = StateStore(state_dir).load(run_id)
    assert saved is not None and saved.last_seq == len(events) - 1 and saved.offset == len(raw)


def test_reapplying_the_same_log_changes_nothing(job) -> None:
    client, experiment_id, run_id, run_dir, raw, state_dir = job
    events, consumed = split_events(raw)
    first = new_sink(client, experiment_id, run_id, run_dir, state_dir)
    first.apply(events, consumed)
    before = snapshot(client, first.run_ids())
    time.sleep(0.01)
    resumed = new_sink(client, experiment_id, run_id, run_dir, state_dir)  # a new process, from saved state
    assert resumed.apply(events, consumed) == []
    assert snapshot(client, resumed.run_ids()) == before


def test_forced_replay_without_saved_state_duplicates_nothing(job) -> None:
    """A crash after applying but before saving replays events: that must be harmless too."""
    client, experiment_id, run_id, run_dir, raw, state_dir = job
    events, consumed = split_events(raw)
    first = new_sink(client, experiment_id, run_id, run_dir, state_dir)
    first.apply(events, consumed)
    before = snapshot(client, first.run_ids())
    replay = new_sink(client, experiment_id, run_id, run_dir, state_dir / "lost")
    assert len(replay.apply(events, consumed)) == len(events)
    assert replay.state.children == first.state.children, "child runs are found again, not created twice"
    assert snapshot(client, replay.run_ids()) == before


def test_delivery_in_pieces_equals_delivery_at_once(job, store) -> None:
    client, experiment_id, run_id, run_dir, raw, state_dir = job
    whole_run = client.create_run(experiment_id).info.run_id
    whole = new_sink(client, experiment_id, whole_run, run_dir, state_dir / "whole")
    whole.apply(*split_events(raw))
    pieces = new_sink(client, experiment_id, run_id, run_dir, state_dir / "pieces")
    offset = 0
    for size in (1, 7, 300, 5, 4096, 10**9):
        events, consumed = split_events(raw[offset : offset + size])
        pieces.apply(events, offset + consumed)
        offset += consumed
    assert offset == len(raw)

    def comparable(sink: MlflowSink) -> list:
        view = snapshot(client, sink.run_ids())
        strip = lambda tags: {k: v for k, v in tags.items() if k != "mlflow.parentRunId"}  # noqa: E731
        return [(p, strip(t), h, a) for p, t, h, a in view.values()]

    assert comparable(pieces) == comparable(whole)


def test_a_gap_in_seq_is_a_warning_and_the_stream_goes_on(job) -> None:
    client, experiment_id, run_id, run_dir, raw, state_dir = job
    events, _ = split_events(raw)
    sink = new_sink(client, experiment_id, run_id, run_dir, state_dir)
    assert [e.seq for e in sink.apply([events[0], events[2]], 0)] == [0, 2]
    assert sink.state.last_seq == 2
    assert "seq 2 follows 0" in client.get_run(run_id).data.tags[EVENT_LOG_WARNINGS]


class Outage(RuntimeError):
    pass


def test_a_batch_mlflow_refused_half_way_moves_nothing_and_lands_whole_later(job, monkeypatch) -> None:
    client, experiment_id, run_id, run_dir, raw, state_dir = job
    events, end = split_events(raw)
    sink = new_sink(client, experiment_id, run_id, run_dir, state_dir)
    calls = {"n": 0}
    real = client.log_batch

    def flaky(*args, **kwargs):  # the second call of the batch finds the store gone
        calls["n"] += 1
        if calls["n"] == 2:
            raise Outage("store gone")
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "log_batch", flaky)
    with pytest.raises(Outage):
        sink.apply(events, end)
    assert (sink.state.last_seq, sink.state.offset) == (-1, 0)
    assert StateStore(state_dir).load(run_id) is None
    assert sink.apply(events, end) != []
    assert sink.state.last_seq == events[-1].seq
    expected = snapshot(client, [run_id, *sink.run_ids()[:-1]])
    fresh = new_sink(client, experiment_id, run_id, run_dir, state_dir / "again")
    fresh.apply(events, end)  # everything once more from scratch: nothing changes, nothing doubles
    assert snapshot(client, [run_id, *sink.run_ids()[:-1]]) == expected


def test_thousands_of_metrics_are_batched_and_all_kept(store, tmp_path: Path) -> None:
    client, experiment_id = store
    run_id = client.create_run(experiment_id).info.run_id
    log = EventLog(tmp_path)
    for step in range(2500):
        log.emit("metrics", {"acceptance_length": float(step % 7)}, step=step)
    log.close()
    sink = new_sink(client, experiment_id, run_id, tmp_path, tmp_path / "state")
    sink.apply(*split_events((tmp_path / EVENTS_FILE).read_bytes()))
    history = client.get_metric_history(run_id, "acceptance_length")
    assert sorted(m.step for m in history) == list(range(2500))


def test_a_file_the_worker_lists_takes_the_tags_the_job_gives_it_in_the_same_batch(job) -> None:
    """The hook a job signs its phase 1 with (`Job._file_tags`): called with the copy that was logged, for the job's
    own run only; its tags land with the batch that logged the file."""
    client, experiment_id, run_id, run_dir, raw, state_dir = job
    seen: list[tuple[str, bytes]] = []

    def file_tags(relative: str, local: Path) -> dict[str, str]:
        seen.append((relative, local.read_bytes()))
        return {"orchestrator.test_file_sha": str(len(local.read_bytes()))}

    states = StateStore(state_dir)
    sink = MlflowSink(client, experiment_id, StreamState(run_id, "local", str(run_dir)), states, LocalTransport(),
                      file_tags)  # fmt: skip
    events, consumed = split_events(raw)
    sink.apply(events, consumed)
    assert seen == [("probe.json", b'{"ok": true}')]
    assert client.get_run(run_id).data.tags["orchestrator.test_file_sha"] == "12"
