"""What a Slurm job makes of Slurm, in process: the reading of `scontrol`, the signals, the run a requeued job
finds again, and how the launcher waits (a fake queue). `test_slurm.py` runs the same against a real cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus

from orchestrator.host.local import LocalTransport
from orchestrator.stream.mirror import EventMirror
from orchestrator.sweep import slurm_launcher
from orchestrator.sweep.job_errors import runless_jobs
from orchestrator.sweep.membership import CANCELLED_FILE
from orchestrator.sweep.slurm import (
    SlurmEnd,
    SlurmJob,
    SlurmSignals,
    SlurmStopped,
    StartedRun,
    current_slurm_job,
    record_run,
    recorded_run,
    seconds,
    why_stopped,
)
from orchestrator.tracking.status import RunStatus

# What `scontrol -o show job` said at the job's SIGTERM on the tests' cluster (Slurm 22.05), field by field.
SCANCEL = {"JobState": "COMPLETING", "Reason": "None", "Restarts": "0", "RunTime": "00:00:03", "TimeLimit": "UNLIMITED"}
TIME_LIMIT = {
    "JobState": "COMPLETING",
    "Reason": "TimeLimit",
    "Restarts": "0",
    "RunTime": "00:01:12",
    "TimeLimit": "00:01:00",
}
REQUEUE = {"JobState": "COMPLETING", "Reason": "None", "Restarts": "1", "RunTime": "00:00:00", "TimeLimit": "UNLIMITED"}


def test_slurm_durations() -> None:
    assert seconds("00:01:00") == 60
    assert seconds("1-02:03:04") == ((24 + 2) * 60 + 3) * 60 + 4
    assert seconds("5:30") == 330  # minutes:seconds
    assert seconds("UNLIMITED") is None and seconds("") is None


def test_what_a_sigterm_from_slurm_means() -> None:
    first = SlurmJob("12_3", restarts=0)
    assert why_stopped(first, SCANCEL) is SlurmEnd.CANCELLED
    assert why_stopped(first, TIME_LIMIT) is SlurmEnd.TIME_LIMIT
    assert why_stopped(first, REQUEUE) is SlurmEnd.REQUEUED
    # Past the limit before slurmctld wrote its reason: the run time says it.
    assert why_stopped(first, {**TIME_LIMIT, "Reason": "None"}) is SlurmEnd.TIME_LIMIT
    # The same job started again (its SLURM_RESTART_COUNT is 1) and then scancelled: not a second requeue.
    assert why_stopped(SlurmJob("12_3", restarts=1), REQUEUE) is SlurmEnd.CANCELLED
    assert why_stopped(first, {}) is SlurmEnd.CANCELLED  # scontrol did not answer: Slurm stopped it, say no more


def test_the_job_is_named_as_squeue_and_scancel_name_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert current_slurm_job() is None
    monkeypatch.setenv("SLURM_JOB_ID", "15")
    assert current_slurm_job() == SlurmJob("15", 0)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert current_slurm_job() == SlurmJob("12_3", 2)


def test_a_requeued_job_finds_the_run_it_started_and_no_other(tmp_path: Path) -> None:
    job = SlurmJob("12_3", 0)
    assert recorded_run(tmp_path, job) is None
    record_run(tmp_path, job, StartedRun("a" * 32, "7"))
    assert recorded_run(tmp_path, SlurmJob("12_3", 1)) == StartedRun("a" * 32, "7")
    assert recorded_run(tmp_path, SlurmJob("13_3", 0)) is None  # the folder of an earlier sweep, used again
    (tmp_path / "slurm_run.json").write_text("{not json")
    assert recorded_run(tmp_path, job) is None


def _in_child(script: str) -> str:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10).stdout.strip()


def test_signals_before_and_after_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR2 ignored here and in what the job starts; SIGTERM remembered until armed, raised once armed,
    then ignored here and in what the job starts while it stops the worker; all restored afterwards."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR2)
    with SlurmSignals(SlurmJob("7", 0)) as signals:
        os.kill(os.getpid(), signal.SIGUSR2)  # would end this process without the ignore
        assert _in_child("kill -USR2 $$; echo alive") == "alive"
        os.kill(os.getpid(), signal.SIGTERM)  # not armed: remembered
        assert signals.signum == signal.SIGTERM
        with pytest.raises(SlurmStopped):
            signals.check()
        assert _in_child("kill -TERM $$; echo alive") == "alive"  # commands run while stopping go on
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR2)) == before
    with SlurmSignals(SlurmJob("7", 0)) as signals:
        signals.arm()
        with pytest.raises(SlurmStopped) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # the handler runs at the next bytecode
        assert "Slurm job 7 got SIGTERM" in str(raised.value)
        signals.disarm()
    with SlurmSignals(None) as signals:  # outside Slurm: nothing changes
        assert signal.getsignal(signal.SIGTERM) == before[0]
        signals.check()


def test_a_new_attempt_of_the_worker_is_not_ended_by_the_last_ones_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = run_dir / "events.jsonl"
    lines = [
        {"seq": 0, "t": 1.0, "kind": "start", "data": {}},
        {"seq": 1, "t": 2.0, "kind": "end", "data": {"status": "KILLED"}},
        {"seq": 2, "t": 3.0, "kind": "start", "data": {}},
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    mirror = EventMirror.at(tmp_path / "mirror.jsonl", str(run_dir))
    mirror.pull(LocalTransport())
    mirror.scan()
    assert mirror.end is None  # the first attempt's end is not the run's
    with log.open("a") as f:
        f.write(json.dumps({"seq": 3, "t": 4.0, "kind": "end", "data": {"status": "FINISHED"}}) + "\n")
    mirror.pull(LocalTransport())
    mirror.scan()
    assert mirror.end is not None and mirror.end.data["status"] == "FINISHED"


# -- the launcher's wait, on a fake queue ----------------------------------------------------------------------


@dataclass
class FakePaths:
    result_pickle: Path


class FakeJob:
    def __init__(self, job_id: str, folder: Path) -> None:
        self.job_id = job_id
        self.paths = FakePaths(folder / f"{job_id}_result.pkl")

    def results(self) -> list[JobReturn]:
        """As submitit's: what the job returned, Hydra's JobReturn around the job's exit code or exception."""
        text = self.paths.result_pickle.read_text()
        if not text.isdigit():
            return [JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError(text))]
        return [JobReturn(status=JobStatus.COMPLETED, _return_value=int(text))]


def test_the_launcher_waits_for_results_and_names_jobs_that_left_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Job 0 writes its result; job 1 leaves the queue without one (cancelled while pending); job 3 raised in
    submitit (its result is the exception); Ctrl-C (the sweep's `cancelled` file) cancels what still waits,
    and job 2 then leaves the queue too."""
    jobs = [FakeJob(f"12_{n}", tmp_path) for n in range(4)]
    jobs[3].paths.result_pickle.write_text("Job not requeued because: timed-out too many times.")
    queue = {"12_0", "12_2"}
    cancelled: list[list[str]] = []
    looks = {"n": 0}

    def listed(arrays: set[str]) -> set[str]:
        assert arrays == {"12"}
        looks["n"] += 1
        if looks["n"] == 2:
            jobs[0].paths.result_pickle.write_text("0")
            queue.discard("12_0")
        if looks["n"] == 4:
            (tmp_path / CANCELLED_FILE).write_text("the sweep was interrupted (Ctrl-C)\n")
        return set(queue)

    def scancel(ids: list[str]) -> None:
        cancelled.append(ids)
        queue.difference_update(ids)

    monkeypatch.setattr(slurm_launcher, "_listed", listed)
    monkeypatch.setattr(slurm_launcher, "_scancel", scancel)
    monkeypatch.setattr(slurm_launcher, "job_fields", lambda job_id: {"JobState": "CANCELLED"})
    monkeypatch.setattr(slurm_launcher, "POLL_S", 0.0)
    monkeypatch.setattr(slurm_launcher, "QUEUE_EVERY_S", 0.0)
    returns = slurm_launcher._wait(tmp_path, [(n, [f"seed={n}"], job) for n, job in enumerate(jobs)])
    killed, failed = RunStatus.KILLED.exit_code, RunStatus.FAILED.exit_code
    assert [r.return_value for r in returns] == [0, killed, killed, failed]
    assert cancelled == [["12_2"]]  # only what still waited, once
    errors = runless_jobs(tmp_path, 0.0)
    assert errors == {
        1: "not started: Slurm job 12_1 was cancelled before it ran",
        2: "not started: the sweep was interrupted (Ctrl-C) (Slurm job 12_2 cancelled)",
        3: "Slurm job 12_3 failed before it had a run: RuntimeError: Job not requeued because: timed-out too many "
        "times.",
    }
    assert "job #2: not started: the sweep was interrupted (Ctrl-C)" in capsys.readouterr().out


def test_a_cancel_mark_is_read_whole_or_not_at_all(tmp_path) -> None:
    """A job polls the mark while another cancels: it reads no mark or the whole first reason, never an
    empty one (the mark used to be created first and filled after), and a second reason never replaces it."""
    import threading

    from orchestrator.sweep.membership import Sweep, cancel_reason

    seen: list[str | None] = []
    for attempt in range(200):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        sweep = Sweep(dir=folder, parent_run_id="p", job_num=0, fail_fast=True)
        stop = threading.Event()

        def poll(folder=folder, stop=stop) -> None:
            while not stop.is_set():
                seen.append(cancel_reason(folder))

        reader = threading.Thread(target=poll)
        reader.start()
        sweep.cancel("job 3 failed: it ran out of memory")
        sweep.cancel("a later reason")
        stop.set()
        reader.join()
        assert cancel_reason(folder) == "job 3 failed: it ran out of memory"
        assert sorted(p.name for p in folder.iterdir()) == ["cancelled"]
    assert set(seen) <= {None, "job 3 failed: it ran out of memory"}
