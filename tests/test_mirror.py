"""The local mirror of the event log stays a byte-exact prefix; MLflow's errors are told apart correctly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import requests
from mlflow.exceptions import MlflowException, RestException

from orchestrator.host.launch import start_worker, stop_worker, write_spec
from orchestrator.host.local import LocalTransport
from orchestrator.host.run_folder import EXIT_CODE_FILE, worker_status
from orchestrator.stream.mirror import EventMirror
from orchestrator.tracking.client import is_outage, short_reason
from tests.fakes import FakeHost, FakeWorker, decode_log


def test_an_append_interrupted_after_its_write_is_redone_not_doubled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=5))
    host.run_dir = "/run"
    host.worker.state = "running"
    mirror = EventMirror.at(tmp_path / "mirror.jsonl", "/run")
    real_fsync = os.fsync
    calls = {"n": 0}

    def interrupted_fsync(fd: int) -> None:  # Ctrl-C lands after the bytes are written, before `size` moves
        calls["n"] += 1
        real_fsync(fd)
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted_fsync)
    mirror.pull(host)
    with pytest.raises(KeyboardInterrupt):
        mirror.pull(host)
    while host.worker.state == "running":
        mirror.pull(host)
    mirror.pull(host)
    assert (tmp_path / "mirror.jsonl").read_bytes() == host.events_written()
    assert mirror.size == len(host.events_written())


def test_a_mirror_reopened_resumes_where_the_file_ends(tmp_path: Path) -> None:
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=3))
    host.run_dir = "/run"
    host.worker.state = "running"
    EventMirror.at(tmp_path / "m.jsonl", "/run").pull(host)
    again = EventMirror.at(tmp_path / "m.jsonl", "/run")
    while host.worker.state == "running":
        again.pull(host)
    again.pull(host)
    again.scan()
    assert (tmp_path / "m.jsonl").read_bytes() == host.events_written()
    assert again.end is not None and again.end.data["status"] == "FINISHED"


def test_outages_are_no_answer_or_5xx_and_never_a_refused_request_or_an_ssh_error() -> None:
    refused = MlflowException(
        "API request to http://h:5000/api/2.0/mlflow/runs/log-batch failed with exception "
        "HTTPConnectionPool(host='h', port=5000): Max retries exceeded"
    )
    assert is_outage(refused)
    assert is_outage(RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "database is locked"}))
    assert is_outage(requests.ConnectionError("refused"))
    assert not is_outage(RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad key"}))
    assert not is_outage(ConnectionResetError("the SSH connection"))
    assert not is_outage(ValueError("a bug"))


def test_outage_messages_carry_no_url_password() -> None:
    error = MlflowException("API request to http://alice:s3cret@h:5000/api/2.0/x failed with exception boom")
    assert "s3cret" not in short_reason(error)


def test_a_worker_stopped_before_it_has_a_pid_never_runs(tmp_path: Path) -> None:
    transport = LocalTransport()
    run_dir = tmp_path / "run"
    write_spec(transport, str(run_dir), {})
    # Stopped while still `starting` (no pid yet): the marker wins over the start that comes after it.
    assert stop_worker(transport, str(run_dir), 1.0).state == "starting"
    marker = tmp_path / "ran"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {marker}\n")
    python.chmod(0o755)
    start_worker(transport, str(run_dir), str(python), "/code", {"HF_TOKEN": "x"})
    deadline = time.monotonic() + 10
    while not (run_dir / EXIT_CODE_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    status = worker_status(transport, str(run_dir))
    assert (status.state, status.exit_code) == ("exited", 143)
    assert not marker.exists() and not (run_dir / "worker.env").exists()
