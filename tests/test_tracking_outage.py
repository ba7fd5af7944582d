"""A real `mlflow server` stopped in the middle of a run and started again: nothing lost, nothing twice.

The worker is a stand-in (`host.python` runs a small script that writes metric events at a steady pace), so
the run lasts as long as the test needs, and the orchestrator is the real one, in its own process.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import JobPaths, group_alive, start_orchestrator
from tests.mlflow_server import start_mlflow_server, stop_mlflow_server
from tests.test_end_to_end import mlflow_metrics, worker_metrics, worker_metrics_for

pytestmark = pytest.mark.slow

# Writes `rounds` metric events, one every `pause` seconds, in the job's run and a child scope, then `end`.
PACED_WORKER = """
import json, os, sys, time
spec = json.load(open(sys.argv[-1]))
rounds, pause = int(os.environ["ROUNDS"]), float(os.environ["PAUSE"])
with open("events.jsonl", "a") as log:
    seq = 0
    def emit(kind, data, **extra):
        global seq
        log.write(json.dumps({"seq": seq, "t": time.time(), "kind": kind, **extra, "data": data}) + "\\n")
        log.flush()
        seq += 1
    emit("start", {"pid": os.getpid()})
    for step in range(rounds):
        emit("metrics", {"acceptance_length": step % 7 + 1.0}, step=step)
        emit("metrics", {"tokens_per_s": 100.0 + step}, scope="ddtree_tb8", step=step)
        time.sleep(pause)
    emit("end", {"status": "FINISHED", "summary": {"rounds": rounds}})
"""


def paced_python(tmp_path: Path) -> str:
    """An interpreter for host.python: the preflight (`-c`) runs for real, `-m remote_worker` runs PACED_WORKER."""
    worker = tmp_path / "paced_worker.py"
    worker.write_text(PACED_WORKER)
    script = tmp_path / "python"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\nexec {sys.executable} {worker} "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def test_mlflow_server_down_mid_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    server_root = tmp_path / "server"
    server_root.mkdir()
    server = start_mlflow_server(server_root)
    port = int(server.uri.rsplit(":", 1)[1])
    paths = JobPaths(workdir=tmp_path / "work", state_dir=tmp_path / "state")
    args = [
        "tracking=server",
        f"tracking.uri={server.uri}",
        "tracking.timeout_s=2",
        "experiment=probe",
        f"host.python={paced_python(tmp_path)}",
        "+host.env.ROUNDS=120",
        "+host.env.PAUSE=0.1",
        "host.gpus=none",
        *paths.overrides(),
    ]
    orchestrator = start_orchestrator(args, tmp_path)
    try:
        client = MlflowClient(tracking_uri=server.uri)
        run_dir = wait_for(lambda: paths.run_dirs() and paths.run_dirs()[0], 120, "the run folder")
        run_id = run_dir.name
        wait_for(lambda: client.get_run(run_id).data.metrics.get("acceptance_length") is not None, 60, "metrics")
        stop_mlflow_server(server)
        down_for = 6.0  # three times tracking.timeout_s: every request in between fails
        time.sleep(down_for)
        server = start_mlflow_server(server_root, port=port)
        stdout, stderr = orchestrator.communicate(timeout=180)
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
            orchestrator.communicate()
        stop_mlflow_server(server)
        server = None
    assert orchestrator.returncode == 0, stdout + stderr
    said = " ".join(stdout.split())  # the terminal folds long lines
    assert said.count("MLflow unreachable since") == 1, stdout
    assert re.search(r"\d+ events? waiting", said) and "MLflow answers again" in said, stdout

    # Every metric the worker wrote is in MLflow once, with the worker's timestamps.
    restarted = start_mlflow_server(server_root, port=port)
    try:
        client = MlflowClient(tracking_uri=restarted.uri)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        written = worker_metrics(run_dir)
        assert len(written["acceptance_length"]) == 120
        assert mlflow_metrics(client, run_id) == written
        children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
        assert len(children) == 1
        assert mlflow_metrics(client, children[0].info.run_id) == worker_metrics_for(run_dir, "ddtree_tb8")
        pgid = int((run_dir / "pid").read_text())
        assert not group_alive(pgid)
    finally:
        stop_mlflow_server(restarted)
