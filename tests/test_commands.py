"""detach=true, list=true and cancel=<run id>, as a user runs them, against a real MLflow server."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import JobPaths, MlflowServer, group_alive, run_orchestrator

pytestmark = pytest.mark.slow


def test_detach_list_and_cancel(mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path) -> None:
    common = ["tracking=server", f"tracking.uri={mlflow_server.uri}", *job_paths.overrides()]
    started = time.monotonic()
    launched = run_orchestrator([*common, "detach=true", "decode.max_new_tokens=400"], tmp_path)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    (run_dir,) = job_paths.run_dirs()
    run_id = run_dir.name
    assert f"attach={run_id}" in launched.stdout
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and run.data.tags["orchestrator.detached"] == "true"
    address = f"{mlflow_server.uri}/#/experiments/{run.info.experiment_id}/runs/{run_id}?workflowType=machine_learning"
    assert launched.stdout.splitlines()[-1] == address, launched.stdout  # as a followed run ends
    assert time.monotonic() - started < 60

    events = run_dir / "events.jsonl"
    while not (events.exists() and b'"progress"' in events.read_bytes()) and time.monotonic() - started < 60:
        time.sleep(0.2)  # the worker's first progress event comes once its imports are done
    listed = run_orchestrator([*common, "list=true"], tmp_path)
    assert listed.returncode == 0 and run_id[:8] in listed.stdout and "running" in listed.stdout
    assert "tiny_trained" in listed.stdout  # from MLflow: the model, when it started
    assert re.search(r" · \d+/\d+", " ".join(listed.stdout.split())), listed.stdout  # the host's last progress event

    logs = run_orchestrator([*common, "logs=last"], tmp_path)
    assert logs.returncode == 0 and "loaded tiny_trained" in logs.stdout, logs.stdout + logs.stderr

    pgid = int((run_dir / "pid").read_text())
    cancelled = run_orchestrator([*common, f"cancel={run_id[:8]}"], tmp_path)  # the prefix `list` shows
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert not group_alive(pgid)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["error"] == "cancelled by the user"
    assert run.data.tags["worker.status"] == "KILLED", "the worker's own end event was applied before ending"

    again = run_orchestrator([*common, "list=true"], tmp_path)
    assert "no active runs" in again.stdout
    everything = run_orchestrator([*common, "list=all"], tmp_path)
    assert run_id[:8] in everything.stdout and "KILLED" in everything.stdout


def test_commands_cannot_be_combined(tmp_path: Path) -> None:
    result = run_orchestrator(["detach=true", "list=true", f"tracking.uri=sqlite:///{tmp_path / 'x.db'}"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "config error: list and detach cannot be combined: choose one"
