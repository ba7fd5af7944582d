"""The host's load as the worker samples it: MLflow's own system-metric names, read back through MLflow's API
from a store the sink wrote, the GPU figures from `nvidia-smi`, and the page's line for a busy host."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.host.local import LocalTransport
from orchestrator.stream.events import split_events
from orchestrator.stream.sink import MlflowSink
from orchestrator.stream.state import StateStore, StreamState
from orchestrator.tracking.job_summary import host_line
from remote_worker import host_load
from remote_worker.events import EVENTS_FILE, EventLog

LINUX = Path("/proc/stat").exists()


@pytest.mark.skipif(not LINUX, reason="the CPU and memory figures read /proc")
def test_a_sample_has_mlflows_names_and_the_cpu_rates_need_a_previous_sample() -> None:
    first, counters = host_load.sample(None)
    assert "system/cpu_utilization_percentage" not in first  # a rate needs two readings
    assert (
        first["system/system_memory_usage_megabytes"] > 0 and 0 < first["system/system_memory_usage_percentage"] < 100
    )
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # this process busy: its own share is not another process's
        pass
    second, _ = host_load.sample(counters)
    assert 0 <= second["system/cpu_utilization_percentage"] <= 100
    assert 0 <= second["system/other_processes_cpu_percentage"] <= second["system/cpu_utilization_percentage"] + 1e-9


def fake_smi(tmp_path: Path, monkeypatch, answer: str) -> None:
    """An `nvidia-smi` on PATH that lists 8 GPUs for `-L` and answers a query with the shell text `answer`
    (after noting its arguments); the module's memory of the last one is forgotten."""
    smi = tmp_path / "nvidia-smi"
    listing = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'; " for i in range(8))
    smi.write_text(
        f'#!/bin/sh\nif [ "$1" = -L ]; then {listing}exit 0; fi\necho "$@" > "$(dirname "$0")/args"\n{answer}\n'
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(host_load, "_gpu_count", None)
    monkeypatch.setattr(host_load, "_warned", set())


def test_the_gpu_figures_come_from_nvidia_smi_for_the_leased_gpus(tmp_path: Path, monkeypatch) -> None:
    fake_smi(tmp_path, monkeypatch, 'echo "37, 1024, 81920, 120.5, 700.00"')
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    metrics, _ = host_load.sample(None)
    assert metrics["system/gpu_0_utilization_percentage"] == 37
    assert metrics["system/gpu_0_memory_usage_megabytes"] == 1024
    assert metrics["system/gpu_0_memory_usage_percentage"] == pytest.approx(100 * 1024 / 81920)
    assert metrics["system/gpu_0_power_usage_watts"] == 120.5
    assert metrics["system/gpu_0_power_usage_percentage"] == pytest.approx(100 * 120.5 / 700)
    assert "--id=3" in (tmp_path / "args").read_text()  # the GPU the worker was leased, as torch's cuda:0


def exited(pid: int, within_s: float) -> bool:
    """Whether `pid` is gone or a zombie within `within_s`. SIGKILL is delivered at once but acted on when the
    process next runs: it closes its files (the pipe the worker waited on) before it becomes a zombie, so on a busy
    machine it can still read as running for a moment after the worker's wait returned."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X") or time.monotonic() > deadline:
            return state in ("Z", "X")
        time.sleep(0.05)


def test_a_hanging_nvidia_smi_is_killed_with_its_children_and_said_once(
    tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_smi(tmp_path, monkeypatch, f"sleep 3600 & echo $! >> {tmp_path}/children; wait")
    monkeypatch.setattr(host_load, "SMI_TIMEOUT_S", 0.5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    samples: list[dict[str, float]] = []

    def sample_twice() -> None:
        for _ in range(2):
            samples.append(host_load.sample(None)[0])

    with caplog.at_level(logging.WARNING, logger="remote_worker.host_load"):
        sampler = threading.Thread(target=sample_twice, daemon=True)
        sampler.start()
        sampler.join(timeout=120)  # 0.5 s each when the group is killed; an hour when only the shell is
    children = [int(pid) for pid in (tmp_path / "children").read_text().split()]
    for child in children:  # the test's own cleanup, whatever the worker did
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert not sampler.is_alive(), "the worker still waits for nvidia-smi's child"
    assert len(samples) == 2 and not any(key.startswith("system/gpu_") for m in samples for key in m)
    assert all(exited(child, within_s=60) for child in children)
    assert [r.getMessage() for r in caplog.records] == [
        "nvidia-smi did not answer within 0.5 s (its process group was killed); GPU figures are left out of the "
        "host's load"
    ]


@pytest.mark.parametrize(
    "answer",
    [
        "i=0; while [ $i -lt 600 ]; do echo '1, 2, 3, 4, 5'; i=$((i+1)); done",  # 600 GPUs on a host of 8
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'",
        "echo '37, 1024, 81920'",
        "echo '37, 1e400, 81920, 1, 2'",
    ],
)
def test_nvidia_smi_output_that_does_not_parse_is_dropped_with_one_warning(
    tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture, answer: str
) -> None:
    fake_smi(tmp_path, monkeypatch, answer)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with caplog.at_level(logging.WARNING, logger="remote_worker.host_load"):
        for _ in range(3):
            metrics, _ = host_load.sample(None)
            assert not any(key.startswith("system/gpu_") for key in metrics)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("nvidia-smi's answer did not parse (") and warning.endswith("left out of the host's load")


@pytest.mark.skipif(not LINUX, reason="the CPU and memory figures read /proc")
def test_the_samples_land_in_mlflows_system_metrics(tmp_path: Path) -> None:
    """The sampler's events, through the sink, read back with MLflow's own API under `system/…`, a history of
    samples whose steps count them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = EventLog(run_dir)
    with host_load.sampling(log, every_s=0.1) as sampler:
        deadline = time.monotonic() + 60  # three samples, however busy the machine (a rate needs two)
        while len(sampler.kept) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    log.close()
    summary = sampler.summary()
    assert summary.samples >= 3 and summary.cpus == os.cpu_count()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = client.create_experiment("load", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment_id).info.run_id
    state = StreamState(run_id=run_id, host="local", run_dir=str(run_dir))
    sink = MlflowSink(client, experiment_id, state, StateStore(tmp_path / "state"), LocalTransport())
    sink.apply(*split_events((run_dir / EVENTS_FILE).read_bytes()))
    metrics = client.get_run(run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes", "system/load_average"} <= set(
        metrics
    )
    history = sorted(client.get_metric_history(run_id, "system/system_memory_usage_megabytes"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(len(history))) and len(history) == summary.samples
    assert [m.value for m in history] == pytest.approx(
        [m["system/system_memory_usage_megabytes"] for _, m in sampler.kept]
    )
    cpu = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert cpu and all(0 <= m.value <= 100 for m in cpu)


def test_a_busy_host_says_so_beside_the_speeds() -> None:
    quiet = host_load.LoadSummary(5, 2, 1.1, 1.4, 95.0, 3.0, 6.0, 1200.0, None)
    busy = host_load.LoadSummary(5, 2, 3.2, 3.9, 99.0, 48.0, 60.0, 1200.0, None)
    assert not quiet.busy and busy.busy
    assert host_line({"host_load": quiet.as_record()}) == (
        "Host while decoding: load average 1.10 (max 1.40) on 2 CPUs, other processes took 3 % of the CPU time "
        "(5 samples; System metrics tab)."
    )
    assert host_line({"host_load": busy.as_record()}).startswith(
        "**Host busy**: other processes took over 25 % of the CPU time: the speeds read low. Host while decoding: "
        "load average 3.20 (max 3.90) on 2 CPUs, other processes took 48 % of the CPU time"
    )
    assert host_line({}) == ""
