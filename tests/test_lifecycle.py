"""The job's lifecycle in-process, over a fake host and a fake tracking store: each fault in milliseconds.

Every test checks what a user would: the exit code, the run's status and error line, that MLflow holds
exactly the metrics the worker wrote (0 lost, 0 duplicated), whether the worker was stopped, and the line
the terminal printed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import posixpath
import re
import shlex
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from rich.console import Console

from orchestrator import CONF_DIR
from orchestrator.cli import app, listing
from orchestrator.config.commands import entry_point
from orchestrator.config.settings import JobConfig
from orchestrator.config.validation import validate
from orchestrator.lifecycle.display import LiveProgress
from orchestrator.lifecycle.errors import LocalFailure
from orchestrator.lifecycle.follow import Follower, FollowSettings
from orchestrator.stream.events import Event
from orchestrator.stream.mirror import EventMirror
from orchestrator.stream.sink import MlflowSink
from orchestrator.stream.state import StateStore
from orchestrator.tracking import tags
from orchestrator.tracking.client import TrackingUnavailable, open_tracking
from tests.conftest import free_port
from tests.fakes import FakeHost, FakeTracking, FakeWorker, decode_log, event_line, renumber, worker_histories


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    """The fake-host settings with `overrides`, composed once per set of overrides (Hydra's compose costs a tenth
    of a second; the trust tests ask for the same settings hundreds of times, in folders of their own)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[
                "tracking=server",
                "tracking.uri=http://fake-mlflow:5000",
                "tracking.outage_wait_s=0.2",
                "orchestrator.state_dir=/unset",
                "orchestrator.poll_interval_s=0.001",
                "orchestrator.kill_grace_s=0.2",
                "host.workdir=/host/work",
                "host.gpus=none",
                *overrides,
            ],
        )


def job_config(tmp_path: Path, *overrides: str) -> JobConfig:
    cfg = copy.deepcopy(_composed(overrides))
    if not any(o.startswith("orchestrator.state_dir=") for o in overrides):
        cfg.orchestrator.state_dir = str(tmp_path / "state")
    return validate(cfg)


class Terminal:
    def __init__(self, width: int = 200) -> None:
        self.buffer = io.StringIO()
        self.console = Console(file=self.buffer, width=width, force_terminal=False)

    @property
    def text(self) -> str:
        return self.buffer.getvalue()

    @property
    def words(self) -> str:
        """The text with every run of spaces and line breaks as one space: a sentence rich wrapped, whole."""
        return " ".join(self.text.split())


def run(config: JobConfig, host: FakeHost, terminal: Terminal | None = None) -> tuple[int, str]:
    terminal = terminal or Terminal()
    code = app.run_config(config, terminal.console, lambda _config: host)
    return code, terminal.text


def the_run(tracking: FakeTracking):
    jobs = [run for run in tracking.runs.values() if tags.PARENT_RUN_ID not in run.tags]
    assert len(jobs) == 1, jobs
    return jobs[0]


def child(tracking: FakeTracking, scope: str):
    return next(run for run in tracking.runs.values() if run.tags.get(tags.SCOPE) == scope)


def assert_exact(tracking: FakeTracking, host: FakeHost) -> None:
    """MLflow holds exactly what the worker wrote, scope by scope: nothing lost, nothing twice."""
    log = host.events_written()
    assert the_run(tracking).history() == worker_histories(log, None)
    scopes = {run.tags[tags.SCOPE] for run in tracking.runs.values() if tags.SCOPE in run.tags}
    assert scopes == {scope for scope in ("ar", "ddtree_tb8") if f'"scope": "{scope}"'.encode() in log}
    for scope in scopes:
        assert child(tracking, scope).history() == worker_histories(log, scope)


def test_a_run_lands_whole(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=3))
    code, out = run(job_config(tmp_path), host)
    assert code == 0, out
    job = the_run(tracking)
    assert job.status == "FINISHED" and child(tracking, "ar").status == "FINISHED"
    assert_exact(tracking, host)
    assert job.artifacts["events.jsonl"] == host.events_written()
    assert "hf_secret" not in job.tags[tags.HYDRA_OVERRIDES]
    assert host.signals_sent() == []


def test_mlflow_down_mid_run_loses_nothing_and_says_so_once(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=40), lines_per_look=1))

    def outage(host: FakeHost) -> None:  # the store goes away for most of the run, then comes back
        tracking.down = 10 <= host.looks < 60

    host.on_look = outage
    code, out = run(job_config(tmp_path), host)
    assert code == 0, out
    assert tracking.refused > 0
    assert out.count("MLflow unreachable since") == 1 and re.search(r"\d+ events? waiting", out)
    assert "MLflow answers again" in out
    assert host.signals_sent() == []  # the worker was never stopped for it
    assert_exact(tracking, host)
    assert the_run(tracking).status == "FINISHED"


def test_mlflow_still_down_after_the_end_leaves_the_run_for_attach_which_completes_it(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=2))
    host.on_look = lambda host: setattr(tracking, "down", host.looks >= 5)
    code, out = run(job_config(tmp_path), host)
    assert code == 75, out
    job = the_run(tracking)
    assert job.status == "RUNNING"
    assert "attach=" in out and "exactly once" in out
    attach_line = next(line for line in out.splitlines() if "attach=" in line)
    assert attach_line.strip().startswith(f"{shlex.join(entry_point())} attach=")  # whole, on its own line

    tracking.down = False
    host.on_look = lambda host: None
    code, out = run(job_config(tmp_path, f"attach={job.run_id}"), host)
    assert code == 0, out
    assert job.status == "FINISHED" and job.tags[tags.DETACHED] == "false"
    assert_exact(tracking, host)


def test_a_worker_that_never_starts_fails_at_launch_with_the_start_commands_stderr(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    worker = FakeWorker(decode_log(), starts=False, start_stderr="sh: 1: setsid: not found\n")
    started = time.monotonic()
    code, out = run(job_config(tmp_path, "orchestrator.start_timeout_s=600"), FakeHost(worker))
    assert time.monotonic() - started < 300, "failed on its stderr, not after orchestrator.start_timeout_s"
    assert code == 1, out
    job = the_run(tracking)
    assert job.status == "FAILED" and job.tags[tags.FAILURE_STAGE] == "launch"
    assert job.tags[tags.ERROR] == "local: the worker did not start: sh: 1: setsid: not found"


def test_a_start_command_that_prints_nothing_fails_after_the_start_timeout(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    code, out = run(
        job_config(tmp_path, "orchestrator.start_timeout_s=0.05"), FakeHost(FakeWorker(decode_log(), starts=False))
    )
    assert code == 1, out
    error = the_run(tracking).tags[tags.ERROR]
    assert "orchestrator.start_timeout_s" in error and error.endswith("the start command printed nothing")


def test_attach_to_a_run_whose_worker_never_started_says_so(tmp_path: Path, tracking: FakeTracking) -> None:
    worker = FakeWorker(decode_log(), starts=False)
    config = job_config(tmp_path, "orchestrator.start_timeout_s=0.05")
    host = FakeHost(worker)
    run(config, host)
    job = the_run(tracking)
    job.status = "RUNNING"  # as if the first orchestrator had died before it could end the run
    assert not [path for path in host.files if path.endswith("/worker.env")]  # the failed launch removed it
    code, out = run(job_config(tmp_path, f"attach={job.run_id}", "orchestrator.start_timeout_s=0.05"), host)
    assert code == 1, out
    assert job.status == "FAILED" and "the worker never started" in job.tags[tags.ERROR]


@pytest.mark.parametrize("mid_sync", [True, False])
def test_attach_to_a_run_whose_orchestrator_died_before_the_launch_says_the_worker_never_started(
    tmp_path: Path, tracking: FakeTracking, mid_sync: bool
) -> None:
    """Killed during the code sync: no run folder on the host, a partial upload named for the run. `attach`
    says the worker never started (not that its folder is gone) and removes the upload then."""
    worker = FakeWorker(decode_log())
    config = job_config(tmp_path)
    made = {tags.MODEL: "tiny_trained", tags.HOST: config.host.name}  # what the run had before the sync began
    run_id = tracking.create_run(tracking.create_experiment("ddtree_gdn"), "r", made).info.run_id
    host = FakeHost(worker)
    other = f"{config.host.workdir}/code/abc.part-12345"  # another sync's copy, still going: kept
    host.files[other + "/remote_worker/__init__.py"] = b""
    if mid_sync:
        host.files[f"{config.host.workdir}/code/abc.part-{run_id}/remote_worker/__init__.py"] = b""
        host.files[f"{config.host.workdir}/code/abc.part-{run_id}.tar.gz"] = b"\x1f\x8b"
    code, out = run(job_config(tmp_path, f"attach={run_id}"), host)
    assert code == 1, out
    run_ = tracking.runs[run_id]
    assert run_.status == "FAILED"
    error = run_.tags[tags.ERROR]
    assert error.startswith("the worker never started: the orchestrator that started this run stopped ")
    assert "gone" not in error
    if mid_sync:
        assert run_.tags[tags.FAILURE_STAGE] == "sync" and "partial upload is now removed" in error
        assert not any(f".part-{run_id}" in p for p in host.files)
    else:
        assert run_.tags[tags.FAILURE_STAGE] == "launch" and "no folder on the host" in error
    assert any(p.startswith(other) for p in host.files)


def test_a_silent_worker_is_said_to_be_alive(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=2), silent_looks=400))
    code, out = run(job_config(tmp_path, "orchestrator.stall_warning_s=0.05"), host)
    assert code == 0, out
    assert "no event from the worker for" in out and "it is alive (pid 4242)" in out


def test_a_worker_that_only_samples_its_host_is_still_silent(tmp_path: Path, tracking: FakeTracking) -> None:
    """A hung decode still sends its host's load every few seconds: those samples are no sign of work, so the
    silence line still comes, and every sample still reaches MLflow's system metrics."""
    lines = decode_log(rounds=2)
    samples = [event_line(0, "metrics", {"system/cpu_utilization_percentage": 99.0}, step=i) for i in range(300)]
    host = FakeHost(FakeWorker(renumber([*lines[:2], *samples, *lines[2:]])))
    code, out = run(job_config(tmp_path, "orchestrator.stall_warning_s=0.05"), host)
    assert code == 0, out
    assert "no event from the worker for" in out and "it is alive (pid 4242)" in out
    (run_,) = [r for r in tracking.runs.values() if tags.PARENT_RUN_ID not in r.tags]
    assert len(run_.history()["system/cpu_utilization_percentage"]) == 300


def test_a_silent_worker_is_mentioned_within_a_minute_then_as_the_silence_doubles(tmp_path: Path) -> None:
    # The default config's first line, on a clock that moves one second each time the orchestrator looks
    # (a status and a read per poll): a worker silent for 17 minutes (a large checkpoint loading), then talking.
    host = FakeHost(FakeWorker(decode_log(rounds=2), silent_looks=1024))
    host.run_dir, host.worker.state = "/host/work/runs/r1", "running"
    host.files["/host/work/runs/r1/pid"] = b"4242\n"
    clock = [0.0]
    host.on_look = lambda _host: clock.__setitem__(0, clock[0] + 1.0)
    terminal = Terminal(width=80)
    settings = FollowSettings(
        poll_interval_s=0.0,
        reconnect_budget_s=1.0,
        start_timeout_s=60.0,
        stall_warning_s=job_config(tmp_path).orchestrator.stall_warning_s,
        exit_grace_s=0.0,
    )

    class Applied:  # the tracking side is not what this test looks at
        def apply(self, *, now: bool = False) -> bool:
            return True

    mirror = EventMirror.at(tmp_path / "mirror.jsonl", host.run_dir)
    live = LiveProgress(terminal.console)
    follower = Follower(host, host.run_dir, mirror, Applied(), live, settings, lambda: None, clock=lambda: clock[0])
    assert follower.run().state == "exited"
    said = [line for line in terminal.text.splitlines() if line.startswith("no event")]
    assert said == [
        f"no event from the worker for {silence}; it is alive (pid 4242)"
        for silence in ("46 s", "90 s", "3 min", "6 min", "12 min")
    ]


def test_the_end_the_worker_recorded_decides_even_when_its_applier_died(tmp_path: Path, tracking: FakeTracking) -> None:
    # An orchestrator applied every event (the end included) and died before ending the run.
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=100))
    config = job_config(tmp_path)
    experiment_id = tracking.create_experiment("ddtree_gdn")
    run_id = tracking.create_run(experiment_id, tags={tags.HOST: config.host.name}).info.run_id
    host.run_dir = f"/host/work/runs/{run_id}"
    host.worker.state = "running"
    host.files[f"{host.run_dir}/spec.json"] = json.dumps({"run_id": run_id}).encode()
    host.files[f"{host.run_dir}/pid"] = b"4242\n"
    while host.worker.state == "running":
        host._look()
    store = StateStore(tmp_path / "state")
    from orchestrator.stream.events import split_events
    from orchestrator.stream.state import StreamState

    sink = MlflowSink(tracking, experiment_id, StreamState(run_id, config.host.name, host.run_dir), store, host)
    sink.apply(*split_events(host.events_written()))
    code, out = run(job_config(tmp_path, f"attach={run_id}"), host)
    assert code == 0, out
    assert tracking.runs[run_id].status == "FINISHED"
    assert_exact(tracking, host)


def test_ctrl_c_after_the_end_event_keeps_the_workers_status(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=100, handles_sigterm=True))
    fired = []

    def ctrl_c_after_end(host: FakeHost) -> None:
        if b'"end"' in host.events_written() and not fired:
            fired.append(1)
            host.worker.state = "running"  # still closing its files
            raise KeyboardInterrupt

    host.on_look = ctrl_c_after_end
    code, out = run(job_config(tmp_path), host)
    assert fired and code == 0, out
    assert the_run(tracking).status == "FINISHED"


def test_ctrl_c_mid_run_stops_the_worker_and_ends_killed(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=40)))
    host.on_look = lambda host: (_ for _ in ()).throw(KeyboardInterrupt) if host.looks == 15 else None
    code, out = run(job_config(tmp_path), host)
    assert code == 130, out
    job = the_run(tracking)
    assert job.status == "KILLED" and "Ctrl-C" in job.tags[tags.ERROR]
    assert host.signals_sent() == ["-TERM"]
    assert_exact(tracking, host)  # the events the worker wrote while stopping landed too


def test_an_unwritable_state_folder_is_one_local_line_and_creates_nothing(
    tmp_path: Path, tracking: FakeTracking, capsys: pytest.CaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = job_config(tmp_path, f"orchestrator.state_dir={blocker / 'state'}")
    code = app.run_config(config, Console(), lambda _config: FakeHost(FakeWorker([])))
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("local: orchestrator.state_dir") and "unreachable" not in err[0]
    assert tracking.runs == {}


def test_a_full_local_disk_mid_run_is_local_and_stops_the_worker(
    tmp_path: Path, tracking: FakeTracking, monkeypatch: pytest.MonkeyPatch
) -> None:
    saves = {"n": 0}
    real_save = StateStore.save

    def save(self, state):
        saves["n"] += 1
        if saves["n"] > 3:
            raise LocalFailure(f"orchestrator.state_dir {tmp_path}: No space left on device")
        return real_save(self, state)

    monkeypatch.setattr(StateStore, "save", save)
    host = FakeHost(FakeWorker(decode_log(rounds=40)))
    code, out = run(job_config(tmp_path), host)
    assert code == 1, out
    job = the_run(tracking)
    assert job.status == "FAILED" and job.tags[tags.FAILURE_STAGE] == "local"
    assert "No space left on device" in job.tags[tags.ERROR] and "unreachable" not in job.tags[tags.ERROR]
    assert host.signals_sent() == ["-TERM"]


def test_a_bug_in_the_sink_is_named_and_stops_the_worker(
    tmp_path: Path, tracking: FakeTracking, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self, event):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(MlflowSink, "_apply_one", broken)
    host = FakeHost(FakeWorker(decode_log(rounds=40)))
    code, out = run(job_config(tmp_path), host)
    assert code == 1, out
    job = the_run(tracking)
    assert job.tags[tags.FAILURE_STAGE] == "local" and "ZeroDivisionError" in job.tags[tags.ERROR]
    assert host.signals_sent() == ["-TERM"]


def test_bad_bytes_in_the_log_are_skipped_with_a_warning(tmp_path: Path, tracking: FakeTracking) -> None:
    lines = decode_log()
    lines.insert(5, b'{"seq": 5, "kind": "metr\xff\n')
    lines = [*lines[:6], *(line for line in lines[6:])]
    host = FakeHost(FakeWorker(lines))
    code, out = run(job_config(tmp_path), host)
    assert code == 0, out
    offset = sum(len(line) for line in lines[:5])
    assert f"malformed line at byte {offset} skipped" in out
    job = the_run(tracking)
    assert f"at byte {offset}" in job.tags[tags.EVENT_LOG_WARNINGS] and job.status == "FINISHED"


def test_a_host_lost_past_its_budget_leaves_the_worker_running_for_attach(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=40)))

    def cut(host: FakeHost) -> None:
        if host.looks == 10:
            host.down = host.stay_down = True

    host.on_look = cut
    code, out = run(job_config(tmp_path, "+host.reconnect_budget_s=0.3"), host)
    assert code == 75, out
    job = the_run(tracking)
    assert job.status == "RUNNING" and job.tags[tags.DETACHED] == "true" and "attach=" in job.tags[tags.ATTACH_COMMAND]
    assert host.signals_sent() == []

    host.down = host.stay_down = False
    host.on_look = lambda host: None
    code, out = run(job_config(tmp_path, f"attach={job.run_id}"), host)
    assert code == 0, out
    assert_exact(tracking, host)


def test_cancel_stops_the_worker_and_ends_killed(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=40)))
    code, _ = run(job_config(tmp_path, "detach=true"), host)
    assert code == 0
    job = the_run(tracking)
    code, out = run(job_config(tmp_path, f"cancel={job.run_id}"), host)
    assert code == 0, out
    assert job.status == "KILLED" and job.tags[tags.ERROR] == "cancelled by the user"
    assert f"cancelled {job.run_id}: its worker was stopped and the run ends KILLED" in out
    assert_exact(tracking, host)


def test_a_cancel_says_what_happened_when_the_worker_had_ended_or_ends_first(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    """The line comes after the fact: a worker that had already finished (its end not yet recorded), one that
    finishes on its own while the cancel is on its way, and a run MLflow already has as ended."""
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=100))
    run(job_config(tmp_path / "a", "detach=true"), host)
    job = the_run(tracking)
    while host.worker.state == "running":
        host._look()
    code, out = run(job_config(tmp_path / "a", f"cancel={job.run_id}"), host)
    assert code == 0 and job.status == "FINISHED" and host.signals_sent() == [], out
    assert f"{job.run_id} had already ended before the cancel: the run ends FINISHED; nothing was stopped" in out
    code, out = run(job_config(tmp_path / "a", f"cancel={job.run_id}"), host)
    assert code == 0 and out.strip().endswith(f"run {job.run_id} has already ended (FINISHED); nothing was cancelled")

    tracking.runs.clear()
    host = FakeHost(FakeWorker(decode_log(rounds=40), lines_per_look=1))
    run(job_config(tmp_path / "b", "detach=true"), host)
    job = the_run(tracking)

    def finishes_first(host: FakeHost) -> None:  # the cancel's mark lands as the worker writes its last lines
        if posixpath.join(host.run_dir, "cancel_requested") in host.files and host.worker.state == "running":
            host.worker.lines_per_look = len(host.worker.lines)

    host.on_look = finishes_first
    code, out = run(job_config(tmp_path / "b", f"cancel={job.run_id}"), host)
    assert code == 0 and job.status == "FINISHED", out
    assert f"{job.run_id} finished before the cancel reached it: the run ends FINISHED" in " ".join(out.split())
    assert_exact(tracking, host)


def test_a_tracking_uri_that_does_not_answer_is_one_line_within_the_timeout(tmp_path: Path) -> None:
    config = job_config(tmp_path, f"tracking.uri=http://127.0.0.1:{free_port()}", "tracking.timeout_s=2")
    with pytest.raises(TrackingUnavailable, match=r"does not answer within 2s") as caught:
        open_tracking(config.tracking)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


def test_event_line_helper_round_trips() -> None:
    assert event_line(3, "log", {"message": "x"}).endswith(b"\n")


def test_a_flush_cut_half_way_then_attach_from_another_machine_loses_nothing(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    # The store drops one call in the middle of a batch (after the job run's part, before a child's), then
    # this orchestrator dies; an attach from a machine without its state trusts the run's cursor tags.
    host = FakeHost(FakeWorker(decode_log(rounds=30), lines_per_look=40))
    tracking.fail_on_calls = set(range(12, 400))
    code, _ = run(job_config(tmp_path, "tracking.outage_wait_s=0"), host)
    assert code == 75
    job = the_run(tracking)
    tracking.fail_on_calls = set()
    other_machine = tmp_path / "elsewhere"
    code, out = run(job_config(other_machine, f"attach={job.run_id}"), host)
    assert code == 0, out
    assert_exact(tracking, host)


def test_a_cut_while_fetching_an_artifact_is_a_reconnect_not_a_local_failure(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    lines = decode_log()
    lines = renumber([*lines[:-1], event_line(0, "artifact", {"path": "probe.json"}), lines[-1]])
    host = FakeHost(FakeWorker(lines, lines_per_look=4))
    real_fetch = host.fetch
    cuts = []

    def fetch_once_cut(path, local):
        if path.endswith("probe.json"):
            host.files[path] = b"{}"
            if not cuts:
                cuts.append(path)
                host.down = True
                raise ConnectionResetError("reset while fetching")
        return real_fetch(path, local)

    host.fetch = fetch_once_cut
    code, out = run(job_config(tmp_path, "+host.reconnect_budget_s=5"), host)
    assert code == 0, out
    assert cuts and "reconnected" in out
    job = the_run(tracking)
    assert job.status == "FINISHED" and "probe.json" in job.artifacts
    assert_exact(tracking, host)


def test_cancel_while_another_process_follows_stops_the_worker_and_leaves_the_end_to_it(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=40)))
    run(job_config(tmp_path, "detach=true"), host)
    job = the_run(tracking)
    follower = StateStore(tmp_path / "state")
    assert follower.lock(job.run_id) is not None  # as another orchestrator process on this machine would
    try:
        code, out = run(job_config(tmp_path, f"cancel={job.run_id}"), host)
    finally:
        follower.release(job.run_id)
    assert code == 0, out
    assert "the orchestrator following it" in out and host.signals_sent() == ["-TERM"]
    assert job.status == "RUNNING"  # the follower ends it, with the worker's own KILLED


def test_a_scope_that_is_not_a_run_name_is_a_warning(tmp_path: Path, tracking: FakeTracking) -> None:
    lines = decode_log()
    lines.insert(3, event_line(3, "metrics", {"x": 1.0}, scope="it's"))
    lines = renumber(lines)
    host = FakeHost(FakeWorker(lines))
    code, out = run(job_config(tmp_path), host)
    assert code == 0, out
    assert "is not a run name" in the_run(tracking).tags[tags.EVENT_LOG_WARNINGS]


# -- the commands that name a run, look at a host, or read a worker's logs ---------------------------------------


def test_a_run_is_named_by_a_prefix_or_last(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=40)))
    run(job_config(tmp_path, "detach=true"), host)
    job = the_run(tracking)
    code, out = run(job_config(tmp_path, f"cancel={job.run_id[:6]}"), host)
    assert code == 0 and f"cancelled {job.run_id}" in out, out
    other = FakeHost(FakeWorker(decode_log(rounds=40)))
    run(job_config(tmp_path, "detach=true"), other)
    newest = next(r for r in tracking.runs.values() if r.status == "RUNNING")
    code, out = run(job_config(tmp_path, "cancel=last"), other)
    assert code == 0 and f"cancelled {newest.run_id}" in out, out


def test_a_prefix_that_names_nothing_or_several_runs_is_one_line(
    tmp_path: Path, tracking: FakeTracking, capsys: pytest.CaptureFixture
) -> None:
    run(job_config(tmp_path, "detach=true"), FakeHost(FakeWorker(decode_log())))
    code, _ = run(job_config(tmp_path, "attach=fffff"), FakeHost(FakeWorker([])))
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["attach: no run of host local has an id starting with fffff"]


def test_list_all_shows_running_and_finished_runs(tmp_path: Path, tracking: FakeTracking) -> None:
    finished = FakeHost(FakeWorker(decode_log()))
    run(job_config(tmp_path), finished)
    host = FakeHost(FakeWorker(decode_log(rounds=40)))
    run(job_config(tmp_path, "detach=true"), host)
    code, out = run(job_config(tmp_path, "list=all"), host)  # the running one is on this host, the other in MLflow
    assert code == 0, out
    ids = {r.run_id[:8] for r in tracking.runs.values() if tags.SCOPE not in r.tags}
    assert all(i in out for i in ids) and "FINISHED" in out


def test_logs_prints_stderr_and_the_workers_log_lines(tmp_path: Path, tracking: FakeTracking) -> None:
    lines = renumber([*decode_log()[:-1], event_line(0, "log", {"message": "loading the draft"}), decode_log()[-1]])
    host = FakeHost(FakeWorker(lines, lines_per_look=100))
    run(job_config(tmp_path), host)
    host.files[f"{host.run_dir}/stderr.log"] = b"Warning: slow tokenizer\n"
    job = the_run(tracking)
    code, out = run(job_config(tmp_path, f"logs={job.run_id[:8]}"), host)
    assert code == 0, out
    assert "stderr  Warning: slow tokenizer" in out and "log       loading the draft" in out


@pytest.mark.parametrize("command", ["list=true", "logs=last", "cancel=last", "attach=last"])
def test_every_command_on_an_unreachable_host_is_one_line(
    command: str, tmp_path: Path, tracking: FakeTracking, capsys: pytest.CaptureFixture
) -> None:
    run(job_config(tmp_path, "detach=true"), FakeHost(FakeWorker(decode_log(rounds=40))))
    capsys.readouterr()
    gone = FakeHost(FakeWorker([]))
    gone.down = gone.stay_down = True
    code, _ = run(job_config(tmp_path, command), gone)
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("local: ") and "reset" in err[0], err
    assert the_run(tracking).status == "RUNNING"  # left exactly as it was


# -- what the terminal shows: progress lines, the list, cancel and attach as the user reads them --------------


def progress(seq: int, task: str, completed: int, total: int, message: str, scope: str | None = None) -> Event:
    data = {"task": task, "completed": completed, "total": total, "message": message}
    return Event(seq, 1_700_000_000.0 + seq, "progress", data, scope=scope)


def test_a_progress_line_fits_80_columns_with_its_count_and_eta_whole() -> None:
    # A long message: what gives way is the bar, then the message's last figures (whole ones: `a · b · c` →
    # `a · b`), never the count or the ETA. Twelve of 120 items in 12 s on the progress's clock: 88 to go at
    # 1/s is an ETA of 0:01:28.
    terminal = Terminal(width=80)
    now = [0.0]
    with LiveProgress(terminal.console, clock=lambda: now[0]) as live:
        live.show(progress(0, "setup", 2, 2, "8 prompts × 5 methods"))
        live.show(progress(1, "decode", 20, 120, "ddtree_tb32 · prompt 2/8", scope="ddtree_tb32"))
        now[0] = 12.0
        message = "[/INST] ddtree_tb32 · prompt 3/8 · tau 4.53 · 300 tok/s"  # the worker's text, not markup
        live.show(progress(2, "decode", 32, 120, message, scope="ddtree_tb32"))
    lines = terminal.text.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    decode = next(line for line in lines if "32/120" in line)
    assert re.fullmatch(r"\S ddtree_tb32 +32/120 \[/INST\] ddtree_tb32 · prompt 3/8 +0:00:12 eta 0:01:28", decode)
    setup = next(line for line in lines if " setup " in line)
    assert re.fullmatch(r" +setup +2/2 +8 prompts × 5 methods +0:00:00 eta 0:00:00", setup), setup  # no room for bars

    wide = Terminal(width=200)  # with room, nothing is cut
    with LiveProgress(wide.console, clock=lambda: now[0]) as live:
        live.show(progress(2, "decode", 32, 120, message, scope="ddtree_tb32"))
    assert f" 32/120 {message} " in wide.text and "…" not in wide.text


@pytest.mark.parametrize("width", [80, 60])
def test_the_progress_a_terminal_keeps_on_screen_has_its_count_and_eta_whole(width: int) -> None:
    # At a terminal rich redraws the bars in place (erase the lines, draw again): what stays on the screen
    # is the last frame, after the last erase. Each of its lines takes the whole width and no more. At 80
    # columns a decode's figures are all there (the method said once, as the label); at 60 the bar gave way,
    # then the last figures, whole; never `32/120` or `0:00:12 eta 0:01:28`.
    screen = io.StringIO()
    console = Console(file=screen, width=width, force_terminal=True, color_system=None)
    now = [0.0]
    with LiveProgress(console, clock=lambda: now[0]) as live:
        live.show(progress(0, "setup", 2, 2, "8 prompts × 5 methods"))
        live.show(progress(1, "decode", 20, 120, "ddtree_tb32 · prompt 2/8", scope="ddtree_tb32"))
        now[0] = 12.0
        message = "ddtree_tb32 · prompt 3/8 · tau 4.53 · 300 tok/s"
        live.show(progress(2, "decode", 32, 120, message, scope="ddtree_tb32"))
    last_frame = screen.getvalue().rsplit("\x1b[2K", 1)[-1].replace("\x1b[?25h", "")  # (the cursor shown again)
    setup, decode = last_frame.splitlines()
    assert len(setup) == len(decode) == width, last_frame
    assert re.fullmatch(r" +setup +(━+ +)?2/2 +8 pro.* 0:00:00 eta 0:00:00", setup), setup
    figures = "prompt 3/8 · tau 4.53 · 300 tok/s" if width == 80 else "prompt 3/8"
    assert re.fullmatch(rf"\S ddtree_tb32 +(━+╸? +)?32/120 {figures} +0:00:12 eta 0:01:28", decode), decode


def launched_and_left(tmp_path: Path, tracking: FakeTracking, lines: list[bytes], looks: int) -> FakeHost:
    """A run started with detach=true whose worker then ran `looks` steps with nobody following it."""
    host = FakeHost(FakeWorker(lines))
    assert run(job_config(tmp_path, "detach=true"), host)[0] == 0
    for _ in range(looks):
        host._look()
    return host


def decode_with_progress() -> list[bytes]:
    """A decode log as ddtree_gdn writes it: progress mid-way and at the end, then the best method's figures."""
    lines = decode_log(rounds=3)
    message = "ddtree_tb32 · prompt 3/8 · tau 4.53 · 300 tok/s"
    middle = event_line(0, "progress", {"task": "decode", "completed": 12, "total": 40, "message": message})
    done = event_line(0, "progress", {"task": "decode", "completed": 40, "total": 40, "message": "done"})
    best = [event_line(0, "metrics", {"best.tau": 4.857}), event_line(0, "tags", {"best.method": "ddtree_tb64"})]
    return renumber([*lines[:3], middle, *lines[3:-1], done, *best, lines[-1]])


def test_list_shows_a_detached_runs_progress_from_the_host(tmp_path: Path, tracking: FakeTracking) -> None:
    host = launched_and_left(tmp_path, tracking, decode_with_progress(), looks=4)
    job = the_run(tracking)
    terminal = Terminal(width=80)
    code, out = run(job_config(tmp_path, "list=true"), host, terminal)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "active runs on local" and all(len(line) <= 80 for line in lines), lines
    row = next(line for line in lines if line.startswith(job.run_id[:8]))
    assert re.match(rf"{job.run_id[:8]}  tiny_trained  decode +\S+ +running +\d+:\d\d:\d\d\b", row), row
    assert "ddtree_tb32 · prompt 3/8 · tau 4.53 · 300 tok/s · 12/40" in terminal.words


def test_list_shows_how_long_a_running_worker_has_been_quiet(
    tmp_path: Path, tracking: FakeTracking, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that has written nothing for 65 s is not simply `running`: the list says since when."""
    host = launched_and_left(tmp_path, tracking, decode_with_progress(), looks=4)
    newest = max(json.loads(line)["t"] for line in host.events_written().splitlines())
    monkeypatch.setattr(listing, "time", SimpleNamespace(time=lambda: newest + 65, strftime=time.strftime,
                                                         localtime=time.localtime))  # fmt: skip
    terminal = Terminal(width=80)
    code, out = run(job_config(tmp_path, "list=true"), host, terminal)
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("run "))
    assert "quiet" in header and re.search(r" running +1:0\d ", out), out


def test_list_says_a_run_whose_worker_ended_unrecorded_is_there_with_its_attach_command(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    host = launched_and_left(tmp_path, tracking, decode_with_progress(), looks=200)
    assert host.worker.state == "exited"
    job = the_run(tracking)
    assert job.status == "RUNNING"  # nobody has applied its end
    for command in ("list=true", "list=all"):
        terminal = Terminal(width=80)
        code, out = run(job_config(tmp_path, command), host, terminal)
        assert code == 0 and "no active runs" not in out, out
        assert all(len(line) <= 80 for line in out.splitlines() if "attach=" not in line), out
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(job.run_id[:8] + "  "))
        assert "RUNNING" not in lines[at] and re.search(r" ended, not +4\.86\b", lines[at]), out
        assert re.match(r" +recorded yet +ddtree_tb64\b", lines[at + 1]), out
        if command == "list=true":  # beside the row; list=all keeps `started`, and its progress goes below
            assert lines[at].rstrip().endswith(" done ·") and lines[at + 1].rstrip().endswith(" 40/40"), out
        else:
            assert f"{job.run_id[:8]}  done · 40/40" in lines, out
        attach = next(line for line in out.splitlines() if "attach=" in line)
        assert attach == (
            f"{job.run_id[:8]} ended, not recorded yet: {shlex.join(entry_point())} attach={job.run_id} host=local "
            "tracking=server tracking.uri=http://fake-mlflow:5000"
        )


def test_list_all_names_the_method_its_tau_is_of(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_with_progress(), lines_per_look=5))
    assert run(job_config(tmp_path), host)[0] == 0
    job = the_run(tracking)
    assert job.tags[tags.BEST_METHOD] == "ddtree_tb64"
    terminal = Terminal(width=80)
    code, out = run(job_config(tmp_path, "list=all"), host, terminal)
    assert code == 0, out
    row = next(line for line in out.splitlines() if line.startswith(job.run_id[:8]))
    assert re.search(r" FINISHED +4\.86 ddtree_tb64", row), out
    # A run whose best was not crowned (too few prompts, overlapping intervals) still has its taus: the
    # highest drafting method's, named (its column was blank on every such run).
    del job.tags[tags.BEST_METHOD]
    job.metrics = {m for m in job.metrics if not m[0].startswith("best.")}
    job.metrics |= {("dflash.tau", 0, 0, 3.3), ("ddtree_tb64.tau", 0, 0, 4.86), ("ar.tau", 0, 0, 1.0)}
    code, out = run(job_config(tmp_path, "list=all"), host, Terminal(width=80))
    row = next(line for line in out.splitlines() if line.startswith(job.run_id[:8]))
    assert re.search(r" FINISHED +4\.86 ddtree_tb64", row), out


def test_logs_names_the_run_and_following_says_how_the_worker_ended(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=20), lines_per_look=1))
    run(job_config(tmp_path, "detach=true"), host)
    job = the_run(tracking)
    host.files[posixpath.join(host.run_dir, "stderr.log")] = b"Warning: slow tokenizer\n"
    host.on_look = lambda host: (
        host.files.__setitem__(  # a cancel from elsewhere, once the worker has run a while
            posixpath.join(host.run_dir, "cancel_requested"), b"cancelled by the user\n"
        )
        if host.looks == 30
        else None
    )
    terminal = Terminal(width=80)
    code, out = run(job_config(tmp_path, f"logs={job.run_id[:8]}", "follow=true"), host, terminal)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == f"logs of run {job.run_id[:8]} on local · tiny_trained · RUNNING"
    assert terminal.words.endswith(
        f"local: run {job.run_id[:8]}: the worker has ended: worker exited with code 0 (cancelled by the user)"
    )


@pytest.mark.parametrize("writes_its_end", [True, False], ids=["worker-ends-killed", "worker-gone-without-end"])
def test_cancel_of_a_followed_run_is_a_cancel_on_both_terminals_and_in_mlflow(
    tmp_path: Path, tracking: FakeTracking, writes_its_end: bool
) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=40), handles_sigterm=writes_its_end))
    cancelling, cancelled = Terminal(width=80), []

    def cancel_from_another_terminal(host: FakeHost) -> None:
        if host.looks == 20 and not cancelled:
            cancelled.append(run(job_config(tmp_path, f"cancel={the_run(tracking).run_id[:8]}"), host, cancelling)[0])

    host.on_look = cancel_from_another_terminal
    following = Terminal(width=80)
    code, out = run(job_config(tmp_path), host, following)
    job = the_run(tracking)
    assert cancelled == [0] and code == 143, out  # not 130, the code of its own Ctrl-C
    assert host.signals_sent() == (["-TERM"] if writes_its_end else ["-TERM", "-KILL"])
    assert f"cancelled {job.run_id}: worker stopped; the orchestrator following it (pid " in cancelling.words
    assert cancelling.words.endswith("ends the run KILLED (cancelled by the user)")
    assert "the run was cancelled by the user (`cancel=` from another command)" in following.words
    assert re.search(r"│ status +│ KILLED +│", out) and re.search(r"│ error +│ cancelled by the user +│", out), out
    assert "signal" not in out and "disappeared" not in out and "worker error" not in out
    assert job.status == "KILLED"
    assert job.tags[tags.ERROR] == "cancelled by the user" and job.tags[tags.FAILURE_STAGE] == "cancel"
    assert job.tags[tags.NOTE].startswith("**KILLED**: cancelled by the user")  # not "No description"
    for scope, child in ((r.tags[tags.SCOPE], r) for r in tracking.runs.values() if tags.SCOPE in r.tags):
        if not child.metrics:  # a method the cancel came before says so, not an empty KILLED page
            assert child.tags[tags.NOTE].startswith(f"**Not finished**: the run ended KILLED, before {scope}'s figures")
    assert_exact(tracking, host)


def test_detach_prints_the_runs_address_and_attach_names_the_runs_model(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(rounds=40)))
    code, out = run(job_config(tmp_path, "detach=true", "model=tiny_dense"), host, Terminal(width=80))
    job = the_run(tracking)
    assert code == 0, out
    assert (
        out.splitlines()[-1]
        == f"http://fake-mlflow:5000/#/experiments/{job.experiment_id}/runs/{job.run_id}?workflowType=machine_learning"
    )
    code, out = run(job_config(tmp_path, f"attach={job.run_id[:8]}"), host)  # model= left at its default
    assert code == 0, out
    assert out.splitlines()[0] == f"attached to {job.run_id} on local · tiny_dense"


# -- a run knows where it lives --------------------------------------------------------------------------------


def test_a_run_launched_in_another_workdir_is_refused_without_it_and_cancelled_with_it(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    """The run's `host.workdir` tag is a claim, never followed: a command whose own work folder differs is
    refused in one line naming both, and changes nothing; the printed command, which carries the launch's
    `host.workdir=`, cancels it."""
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=1))
    run(job_config(tmp_path, "detach=true", "host.workdir=/host/elsewhere"), host)
    job = the_run(tracking)
    assert job.tags[tags.HOST_WORKDIR] == "/host/elsewhere" and job.tags[tags.HOST_RUN_DIR] == host.run_dir
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code, _ = run(job_config(tmp_path, f"cancel={job.run_id}"), host)
    assert code == 2 and job.status == "RUNNING" and host.signals_sent() == []
    assert err.getvalue().strip() == (
        f"cancel: run {job.run_id[:8]} records host.workdir=/host/elsewhere; this command's is /host/work. A tag "
        "is never followed: give host.workdir=/host/elsewhere if that is where you launched it"
    )
    # a forged tag's folder is quoted for the shell in the advice: pasted, `$(…)` stays part of a word
    job.tags[tags.HOST_WORKDIR] = "/host/$(touch pwned)"
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code, _ = run(job_config(tmp_path, f"cancel={job.run_id}"), host)
    assert code == 2 and err.getvalue().strip().endswith(
        "A tag is never followed: give 'host.workdir=/host/$(touch pwned)' if that is where you launched it"
    )
    job.tags[tags.HOST_WORKDIR] = "/host/elsewhere"
    code, out = run(job_config(tmp_path, f"cancel={job.run_id}", "host.workdir=/host/elsewhere"), host)
    assert code == 0 and job.status == "KILLED", out
    assert host.run_dir.startswith("/host/elsewhere/runs/") and host.signals_sent() == ["-TERM"]


@pytest.mark.parametrize("command", ["attach", "cancel"])
def test_a_run_folder_missing_where_the_run_says_changes_nothing(
    tmp_path: Path, tracking: FakeTracking, command: str
) -> None:
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=1))
    run(job_config(tmp_path, "detach=true"), host)
    job = the_run(tracking)
    for path in [p for p in host.files if p.startswith(host.run_dir + "/")]:
        del host.files[path]  # the folder removed from the host (or the host is not the one the run used)
    host.worker.state = "gone"
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code, _ = run(job_config(tmp_path, f"{command}={job.run_id}"), host)
    assert code == 1 and job.status == "RUNNING"
    assert err.getvalue().strip() == (
        f"local: run {job.run_id[:8]} has no folder at {host.run_dir}, where it lives in host.workdir; nothing was "
        "changed"
    )


def test_cancel_last_means_this_workdirs_newest_run(tmp_path: Path, tracking: FakeTracking) -> None:
    host = FakeHost(FakeWorker(decode_log(), lines_per_look=1))
    run(job_config(tmp_path, "detach=true", "host.workdir=/host/elsewhere"), host)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code, _ = run(job_config(tmp_path, "cancel=last", "host.workdir=/host/empty"), host)
    assert code == 2 and the_run(tracking).status == "RUNNING" and host.signals_sent() == []
    assert err.getvalue().strip() == (
        f"cancel: last: you launched no run from this machine to host local in /host/empty (this state folder: "
        f"{tmp_path / 'state'}); name the run by its id"
    )


def test_cancel_of_a_run_whose_launch_never_started_removes_its_worker_env(
    tmp_path: Path, tracking: FakeTracking
) -> None:
    """Its orchestrator died between writing worker.env and the supervisor's start: the cancel (and an
    attach, the same way) removes the file that holds the worker's secrets."""
    worker = FakeWorker(decode_log(), starts=False)
    host = FakeHost(worker)
    run(job_config(tmp_path, "orchestrator.start_timeout_s=0.05"), host)
    job = the_run(tracking)
    job.status = "RUNNING"
    host.files[posixpath.join(host.run_dir, "worker.env")] = b"export HF_TOKEN=hf_secret\n"
    host.files.pop(posixpath.join(host.run_dir, "stderr.log"), None)  # still `starting`: never started
    code, out = run(job_config(tmp_path, f"cancel={job.run_id}", "orchestrator.start_timeout_s=0.05"), host)
    assert code == 0 and job.status == "KILLED", out
    assert posixpath.join(host.run_dir, "worker.env") not in host.files


def test_list_all_at_80_columns_keeps_started_and_tells_the_kinds_of_run_apart() -> None:
    now = time.time()
    rows = [
        listing.Listed("5fbe2b5c" + "0" * 24, "tiny_trained_dense", now - 3600, None, "running",
                       "ddtree_tb32 · prompt 3/8 · tau 4.53 · 300 tok/s", "", now - 65, "sweep #3"),
        listing.Listed("6abe2b5c" + "0" * 24, "tiny_trained", now - 7200, now - 7000, "FINISHED", "",
                       "4.86 ddtree_tb64", None, "decode"),
        listing.Listed("7cbe2b5c" + "0" * 24, "qwen3_6_27b", now - 9200, now - 9000, "KILLED", "", "", None,
                       "node cost"),
        listing.Listed("8dbe2b5c" + "0" * 24, "tiny_trained", now - 9300, now - 9200, "FINISHED", "", "", None,
                       "probe"),
    ]  # fmt: skip
    terminal = Terminal(width=80)
    terminal.console.print(listing.runs_table(rows, 80, started=True))
    lines = terminal.text.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in terminal.text, terminal.text
    assert re.split(r"\s+", lines[0].strip()) == ["run", "model", "what", "started", "state", "quiet", "tau"]
    for kind in ("sweep #3", "decode", "node cost", "probe"):
        assert kind in terminal.text


def test_a_count_of_work_in_the_thousands_is_shown_as_a_percent() -> None:
    """Node-cost progress counts node-rounds (9216 of them): `3456/9216` says nothing and took the message's
    room at 80 columns; it reads `37%`, while a count of prompts stays `17/40`."""
    terminal = Terminal(width=80)
    with LiveProgress(terminal.console, clock=lambda: 0.0) as live:
        live.show(progress(0, "decode", 17, 40, "ddtree_tb16 · prompt 4/8 · tau 4.11"))
        live.show(progress(1, "node costs", 3456, 9216, "65 nodes: verify 3.75 ms"))
    lines = terminal.text.splitlines()
    assert any(re.search(r" node costs .* 37% +65 nodes: verify 3\.75 ms ", line) for line in lines), lines
    assert any(re.search(r" decode .* 17/40 ddtree_tb16 · prompt 4/8 · tau 4\.11 ", line) for line in lines), lines


def test_a_cancelled_runs_page_counts_the_decodes_that_ran(tmp_path: Path, tracking: FakeTracking) -> None:
    """14 of 40 decodes had run when the cancel came: the page says so, not that nothing was decoded."""
    lines = decode_log(rounds=2)[:2]
    for done in range(15):
        data = {"task": "decode", "completed": done, "total": 40, "message": f"ar · prompt {done // 5 + 1}/8"}
        lines.append(event_line(len(lines), "progress", data))
    lines += [event_line(len(lines), "log", {"message": "still decoding"})] * 50
    host = FakeHost(FakeWorker(renumber(lines), lines_per_look=1))
    run(job_config(tmp_path, "detach=true"), host)
    job = the_run(tracking)
    while host.worker.written < 20:
        host._look()
    code, out = run(job_config(tmp_path, f"cancel={job.run_id}"), host)
    assert code == 0 and job.status == "KILLED", out
    assert job.tags[tags.NOTE] == "**KILLED**: cancelled by the user\n\n14 of 40 decodes ran before the end."


def test_the_eta_counts_down_between_reports_and_holds_steady_when_methods_alternate() -> None:
    """Five methods take turns, AR's decode 1 s and the others' 4 s (a cycle of 17 s for 5 decodes): the ETA
    follows the rate since the task was first seen, so after one cycle it stays within a cycle of the truth
    (rich's own, from the last 30 s, swung by minutes), and between two reports it counts down instead of
    freezing."""
    from orchestrator.lifecycle.display import _EtaColumn

    now = [0.0]
    live = LiveProgress(Terminal().console, clock=lambda: now[0])
    column = _EtaColumn(lambda: now[0])
    durations = [1.0, 4.0, 4.0, 4.0, 4.0] * 8  # 40 decodes: 136 s in all
    live.show(progress(0, "decode", 0, 40, "ar · prompt 1/8", scope="ar"))
    (task,) = live._progress.tasks

    def eta() -> int:
        h, m, s = (int(part) for part in str(column.render(task)).split(":"))
        return 3600 * h + 60 * m + s

    for done, seconds in enumerate(durations, start=1):
        now[0] += seconds
        live.show(progress(done, "decode", done, 40, "x", scope="ar"))
        truth = sum(durations[done:])
        if done >= 5 and done < 40:
            assert abs(eta() - truth) <= 17, (done, eta(), truth)
            before = eta()
            now[0] += 2.0  # two seconds pass without a report: the ETA counts them down
            assert eta() == max(0, before - 2)
            now[0] -= 2.0
    assert eta() == 0
