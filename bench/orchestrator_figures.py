"""The orchestrator's figures, over a real sshd on 127.0.0.1 and a real `mlflow server` on loopback.

1. Sync: a full copy of the worker's code (rsync and tar), an unchanged tree, and a one-file change
   (rsync hard-links the rest from the previous snapshot; tar sends everything again); the same with 10 MiB
   of incompressible files added, the size of the model fixtures a tree may carry.
2. Event-to-MLflow latency: a writer appends metric events at a steady rate; the orchestrator's own follow
   loop (`Follower`, reading over SFTP into its mirror) applies them; each event's latency is from the
   worker's timestamp to the moment its `log_batch` returned.
3. Sink throughput: the same metric events applied by the sink (packed `log_batch` calls) against one
   `log_metric` call per metric, timed alternately on one server.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mlflow.tracking import MlflowClient

from orchestrator import PROJECT_ROOT
from orchestrator.host.local import LocalTransport
from orchestrator.host.ssh import SSHTransport
from orchestrator.host.sync import sync_code
from orchestrator.lifecycle.follow import Applier, Follower, FollowSettings
from orchestrator.stream.events import Event, split_events
from orchestrator.stream.mirror import EventMirror
from orchestrator.stream.sink import MlflowSink
from orchestrator.stream.state import StateStore, StreamState
from remote_worker.events import EventLog
from tests.mlflow_server import start_mlflow_server, stop_mlflow_server
from tests.sshd import SSHServer, sshd_available, start_sshd, stop_sshd

POLL_INTERVAL_S = 0.25  # conf/config.yaml's orchestrator.poll_interval_s


def _median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def sync_times(server: SSHServer, root: Path, repeats: int, extra_mib: int = 0) -> dict[str, Any]:
    """Sync times of the worker's code, plus `extra_mib` files of 1 MiB of random (incompressible) bytes."""
    tree = root / "checkout"
    shutil.copytree(
        PROJECT_ROOT / "remote_worker", tree / "remote_worker", ignore=shutil.ignore_patterns("__pycache__")
    )
    for i in range(extra_mib):
        (tree / "remote_worker" / f"blob{i}.bin").write_bytes(os.urandom(1 << 20))
    changing = tree / "remote_worker" / "runner.py"
    original = changing.read_text()
    transport = SSHTransport(server.host_config(root, keepalive_s=5))
    transport.open()
    times: dict[str, list[float]] = {
        k: [] for k in ("full_rsync", "full_tar", "unchanged", "one_file_rsync", "one_file_tar")
    }
    try:
        for i in range(repeats):
            for method in ("rsync", "tar"):
                workdir = str(root / f"remote-{method}-{i}")
                changing.write_text(original)
                start = time.perf_counter()
                assert sync_code(transport, workdir, root=tree, method=method)[1]
                times[f"full_{method}"].append(time.perf_counter() - start)
                start = time.perf_counter()
                assert not sync_code(transport, workdir, root=tree, method=method)[1]
                times["unchanged"].append(time.perf_counter() - start)
                changing.write_text(f"{original}\n# change {i}\n")
                start = time.perf_counter()
                assert sync_code(transport, workdir, root=tree, method=method)[1]
                times[f"one_file_{method}"].append(time.perf_counter() - start)
    finally:
        transport.close()
    files = [p for p in (tree / "remote_worker").rglob("*") if p.is_file()]
    return {
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        **{f"{k}_ms": _median_ms(v) for k, v in times.items()},
    }


def _sink(client: MlflowClient, experiment_id: str, run_dir: Path, state_dir: Path, transport) -> MlflowSink:
    run_id = client.create_run(experiment_id).info.run_id
    states = StateStore(state_dir)
    return MlflowSink(client, experiment_id, StreamState(run_id, "bench", str(run_dir)), states, transport)


def event_latency(server: SSHServer, client: MlflowClient, experiment_id: str, root: Path, events: int) -> dict:
    """p50/p95 from the worker's write to MLflow, with events every 20 ms through the real follow loop."""
    run_dir = root / "latency-run"
    run_dir.mkdir()
    transport = SSHTransport(server.host_config(root, keepalive_s=5))
    transport.open()
    sink = _sink(client, experiment_id, run_dir, root / "latency-state", transport)
    log = EventLog(run_dir)
    log.emit("start", {"pid": 0})

    def write() -> None:
        for step in range(events):
            log.emit("metrics", {"acceptance_length": float(step % 7)}, scope=None, step=step)
            time.sleep(0.02)
        log.emit("end", {"status": "FINISHED"})
        log.close()

    latencies: list[float] = []
    apply = sink.apply

    def timed_apply(events: list[Event], end_offset: int) -> list[Event]:
        fresh = apply(events, end_offset)  # returns once MLflow has taken the batch
        latencies.extend(time.time() - event.t for event in fresh if event.kind == "metrics")
        return fresh

    sink.apply = timed_apply  # type: ignore[method-assign]
    mirror = EventMirror.at(root / "latency-mirror.jsonl", str(run_dir))
    terminal = SimpleNamespace(show=lambda event: None, note=print)
    settings = FollowSettings(POLL_INTERVAL_S, 60.0, 60.0, float("inf"), exit_grace_s=0.1)
    follower = Follower(transport, str(run_dir), mirror, Applier(sink, mirror, print), terminal, settings, lambda: None)
    writer = threading.Thread(target=write)
    writer.start()
    try:
        follower.run()
    finally:
        writer.join()
        transport.close()
    assert len(latencies) == events
    ordered = sorted(latencies)
    return {
        "events": events,
        "poll_interval_s": POLL_INTERVAL_S,
        "p50_ms": 1000 * statistics.median(ordered),
        "p95_ms": 1000 * ordered[int(0.95 * (len(ordered) - 1))],
    }


def sink_throughput(client: MlflowClient, experiment_id: str, root: Path, metrics: int, repeats: int) -> dict:
    """Metrics per second: the sink's batches against one `log_metric` call per metric."""
    sink_rates, call_rates = [], []
    for i in range(repeats):
        run_dir = root / f"throughput-{i}"
        run_dir.mkdir()
        log = EventLog(run_dir)
        for step in range(metrics):
            log.emit("metrics", {"acceptance_length": float(step % 7)}, scope="ddtree_tb32", step=step)
        log.close()
        sink = _sink(client, experiment_id, run_dir, root / f"throughput-state-{i}", LocalTransport())
        start = time.perf_counter()
        sink.apply(*split_events((run_dir / "events.jsonl").read_bytes()))
        sink_rates.append(metrics / (time.perf_counter() - start))
        run_id = client.create_run(experiment_id).info.run_id
        start = time.perf_counter()
        for step in range(metrics):
            client.log_metric(run_id, "acceptance_length", float(step % 7), step=step)
        call_rates.append(metrics / (time.perf_counter() - start))
    sink_rate, call_rate = statistics.median(sink_rates), statistics.median(call_rates)
    return {"metrics": metrics, "sink_per_s": sink_rate, "per_call_per_s": call_rate, "ratio": sink_rate / call_rate}


def orchestrator_figures(repeats: int) -> dict[str, Any]:
    reason = sshd_available()
    if reason is not None:
        return {"skipped": reason}
    with tempfile.TemporaryDirectory(prefix="bench-orchestrator-") as tmp:
        root = Path(tmp)
        server = start_sshd(root / "sshd")
        mlflow = start_mlflow_server(_mkdir(root / "mlflow"))
        try:
            client = MlflowClient(tracking_uri=mlflow.uri)
            experiment_id = client.create_experiment("bench")
            return {
                "sync": sync_times(server, _mkdir(root / "sync"), repeats=max(3, repeats // 6)),
                "sync_large": sync_times(server, _mkdir(root / "sync-large"), repeats=3, extra_mib=10),
                "event_latency": event_latency(server, client, experiment_id, _mkdir(root / "latency"), events=200),
                "sink_throughput": sink_throughput(
                    client, experiment_id, _mkdir(root / "throughput"), metrics=1000, repeats=3
                ),
            }
        finally:
            stop_mlflow_server(mlflow)
            stop_sshd(server)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path
