"""Detached launch on the local host: pid and exit code files, stopping a process group, literal arguments."""

from __future__ import annotations

import itertools
import os
import signal
import stat
import time
from pathlib import Path

from orchestrator.launch import (
    EXIT_CODE_FILE,
    LEASE_FILE,
    PID_FILE,
    SPEC_FILE,
    start_worker,
    stop_worker,
    wait_for_start,
    worker_status,
    write_spec,
)
from orchestrator.transport import LocalTransport
from tests.conftest import group_alive

transport = LocalTransport()


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for the interpreter; it gets `-m remote_worker run spec.json` as arguments."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_spec_and_run_dir_are_private(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r1"
    write_spec(transport, str(run_dir), {"run_id": "r1"})
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / SPEC_FILE).stat().st_mode) == 0o600


def test_exit_code_and_arguments_are_recorded(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_spec(transport, str(run_dir), {})
    python = fake_python(tmp_path, 'echo "$@" > args; echo "$PYTHONPATH $EXTRA" > env; exit 3')
    start_worker(transport, str(run_dir), python, "/code/dir", {"EXTRA": "x y"})
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    status = worker_status(transport, str(run_dir))
    assert (status.state, status.exit_code) == ("exited", 3)
    assert (run_dir / "args").read_text() == "-m remote_worker run spec.json\n"
    assert (run_dir / "env").read_text() == "/code/dir x y\n"
    assert status.describe() == "worker exited with code 3"


def test_shell_syntax_in_paths_and_env_is_taken_literally(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    run_dir = tmp_path / f"odd dir; touch {marker}; $(touch {marker}) `touch {marker}`"
    write_spec(transport, str(run_dir), {})
    python = fake_python(tmp_path, 'echo "$VALUE" > value')
    start_worker(transport, str(run_dir), python, f"/code; touch {marker}", {"VALUE": f"'; touch {marker}; '"})
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    assert (run_dir / "value").read_text() == f"'; touch {marker}; '\n"
    assert not marker.exists()


def test_worker_survives_in_its_own_session_and_stop_kills_the_group(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_spec(transport, str(run_dir), {})
    # Ignores SIGTERM, so only the SIGKILL after the grace period can end it; `sleep` is a child in its group.
    python = fake_python(tmp_path, "trap '' TERM; sleep 60 & wait; sleep 60")
    start_worker(transport, str(run_dir), python, "/code", {})
    status = wait_for_start(transport, str(run_dir))
    assert status.state == "running" and status.pid is not None
    assert os.getpgid(status.pid) == status.pid == os.getsid(status.pid), "leader of its own session and group"
    started = time.monotonic()
    final = stop_worker(transport, str(run_dir), grace_s=1.0)
    assert time.monotonic() - started < 10
    assert not final.alive
    assert wait_until(lambda: not group_alive(status.pid), timeout=5)


def test_a_group_killed_outright_is_reported_as_vanished(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_spec(transport, str(run_dir), {})
    start_worker(transport, str(run_dir), fake_python(tmp_path, "sleep 60"), "/code", {})
    status = wait_for_start(transport, str(run_dir))
    pgid = int((run_dir / PID_FILE).read_text())
    assert status.pid == pgid
    os.killpg(pgid, signal.SIGKILL)
    assert wait_until(lambda: not group_alive(pgid), timeout=5)
    gone = worker_status(transport, str(run_dir))
    assert gone.state == "vanished"
    assert "without writing an exit code" in gone.describe()


def assert_never_shared(intervals: list[tuple[str, float, float]]) -> None:
    """No two (gpu, start, end) intervals on one GPU overlap."""
    for (gpu_a, start_a, end_a), (gpu_b, start_b, end_b) in itertools.combinations(intervals, 2):
        if gpu_a == gpu_b:
            assert end_a <= start_b or end_b <= start_a, f"two jobs held GPU {gpu_a} at the same time"


def test_gpu_leases_are_never_shared_and_a_third_job_waits(tmp_path: Path) -> None:
    """Two GPU slots, three jobs at once: each job holds one slot for its whole life; the third waits."""
    python = fake_python(tmp_path, 'echo "$CUDA_VISIBLE_DEVICES $(date +%s.%N)" > used; sleep 1.5; date +%s.%N >> used')
    run_dirs = [tmp_path / f"run{i}" for i in range(3)]
    for run_dir in run_dirs:
        write_spec(transport, str(run_dir), {})
        start_worker(transport, str(run_dir), python, "/code", {}, gpus=[0, 1], locks_dir=str(tmp_path / "locks"))
    saw_waiting = wait_until(lambda: any(worker_status(transport, str(d)).state == "waiting" for d in run_dirs))
    assert all(wait_until(lambda d=d: (d / EXIT_CODE_FILE).exists(), timeout=30) for d in run_dirs)
    used, leased = [], []
    for run_dir in run_dirs:
        gpu, start, end = (run_dir / "used").read_text().split()
        lease_gpu, lease_start, lease_end = (run_dir / LEASE_FILE).read_text().split()
        assert gpu == lease_gpu
        assert float(lease_start) <= float(start) <= float(end) <= float(lease_end), "the worker ran inside its lease"
        used.append((gpu, float(start), float(end)))
        leased.append((gpu, float(lease_start), float(lease_end)))
    assert_never_shared(used)
    assert_never_shared(leased)
    assert {gpu for gpu, _, _ in used} == {"0", "1"}
    assert saw_waiting, "with both slots taken the third job reports that it waits"
