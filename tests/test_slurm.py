"""Sweeps through a real Slurm cluster (`tests/slurm.py`): a grid ends with every job a FINISHED child run, and
what Slurm does to a job (scancel, its time limit, a requeue, the sweep's Ctrl-C) becomes the run's status
and error line, with no process of the worker left behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from orchestrator.host.run_folder import PID_FILE
from tests.conftest import MlflowServer, group_alive, run_orchestrator, start_orchestrator
from tests.slurm import SlurmCluster

pytestmark = pytest.mark.slow

# A worker that decodes for minutes (far longer than any of these tests lets it), and one of about 20 s.
DECODE = ("model=tiny_hybrid", "decode.tree_budgets=[8]")
LONG_DECODE = (
    *DECODE,
    "experiment.num_prompts=6",
    "decode.max_new_tokens=1000",
    "decode.repeats=20",
    "decode.node_costs=false",
)
SHORT_DECODE = (*DECODE, "experiment.num_prompts=2", "decode.max_new_tokens=96")


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[SlurmCluster]:
    """The cluster, reachable from this test and from every orchestrator and Slurm job it starts; whatever
    the test leaves (it failed half-way) is stopped after it: its sweep's Slurm jobs, by id."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)
    yield slurm_cluster
    if ids := slurm_ids(tmp_path):
        slurm_cluster.command("scancel", *ids.values(), check=False)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """`start_orchestrator`, with every process it started killed (its group) if the test left it running."""
    started: list[subprocess.Popen] = []

    def start_(args: list[str], own_group: bool = False) -> subprocess.Popen:
        started.append(start_orchestrator(args, tmp_path, own_group=True))
        return started[-1]

    yield start_
    for process in started:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


def slurm_args(cluster: SlurmCluster, server: MlflowServer, tmp_path: Path, *args: str) -> list[str]:
    return [
        "--multirun",
        "hydra/launcher=submitit_slurm",
        f"hydra.launcher.partition={cluster.partition}",
        "hydra.launcher.timeout_min=10",
        *args,
        f"host.workdir={tmp_path / 'work'}",
        f"orchestrator.state_dir={tmp_path / 'state'}",
        f"host.gpu_lock_dir={tmp_path / 'locks'}",
        "tracking=server",
        f"tracking.uri={server.uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]


def sweep_runs(client: MlflowClient, tmp_path: Path) -> tuple[Run, list[Run]]:
    parent_id = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["parent_run_id"]
    parent = client.get_run(parent_id)
    jobs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return parent, sorted(jobs, key=lambda r: int(r.data.tags["sweep.job"]))


def slurm_ids(tmp_path: Path) -> dict[int, str]:
    path = tmp_path / "sweep" / "slurm_jobs.json"
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def wait_for(what: str, condition: Callable[[], object], timeout_s: float, process: subprocess.Popen) -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the sweep ended before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:g}s")
        time.sleep(0.3)
    return value


def running_worker(tmp_path: Path) -> Callable[[], Path | None]:
    """The run folder of a worker that has begun decoding (its pid written, a progress event logged)."""

    def find() -> Path | None:
        for run_dir in sorted((tmp_path / "work" / "runs").glob("*")):
            events = run_dir / "events.jsonl"
            if (run_dir / PID_FILE).exists() and events.exists() and '"kind":"progress"' in events.read_text():
                return run_dir
        return None

    return find


def with_worker(
    start: Callable[..., subprocess.Popen], args: list[str], tmp_path: Path
) -> tuple[subprocess.Popen, Path]:
    """Start the sweep and wait until its (first) worker decodes; the process and that worker's run folder."""
    process = start(args)
    run_dir = wait_for("a running worker", running_worker(tmp_path), 180, process)
    assert isinstance(run_dir, Path)
    return process, run_dir


def another_terminal(command: str, server: MlflowServer, tmp_path: Path) -> subprocess.CompletedProcess:
    """`list=true`, `logs=<run>`, `cancel=<run>` as a user types them elsewhere, against the same work dir."""
    folder = tmp_path / command.split("=")[0]
    folder.mkdir()
    paths = [f"host.workdir={tmp_path / 'work'}", f"orchestrator.state_dir={tmp_path / 'state'}"]
    return run_orchestrator([command, *paths, "tracking=server", f"tracking.uri={server.uri}"], folder, timeout=120)


def finish(process: subprocess.Popen, timeout_s: float = 240) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the sweep did not end in {timeout_s:g}s\n{out}\n{err}")


def assert_nothing_left(run_dir: Path) -> None:
    """No process of the worker survives: its process group is gone, and no process runs in its run folder."""
    pgid = int((run_dir / PID_FILE).read_text())
    deadline = time.monotonic() + 15  # the job's SIGKILL (after STOP_GRACE_S) may land a moment after its end
    while True:
        in_folder = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(proc / "cwd") == str(run_dir):
                        in_folder.append(int(proc.name))
        if not group_alive(pgid) and not in_folder:
            return
        if time.monotonic() > deadline:
            ps = subprocess.run(["ps", "-eo", "pid,pgid,args"], capture_output=True, text=True).stdout
            pytest.fail(f"worker processes survived (group {pgid}, in its folder {in_folder}):\n{ps}")
        time.sleep(0.2)


def test_a_grid_through_slurm_ends_with_every_job_a_finished_child_run(
    slurm: SlurmCluster, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """`make sweep`'s grid (its temperature and block size fixed: 2 jobs, one per model), each job a Slurm array
    task on the cluster's node."""
    args = ["sweep=default", "decode.temperature=0", "decode.block_size=4", "experiment.num_prompts=1",
            "decode.max_new_tokens=16", "decode.node_costs=false"]  # fmt: skip
    result = run_orchestrator(slurm_args(slurm, mlflow_server, tmp_path, *args), tmp_path, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.launcher"] == "submitit_slurm"
    assert [j.info.status for j in jobs] == ["FINISHED"] * 2
    ids = slurm_ids(tmp_path)
    assert [j.data.tags["slurm.job_id"] for j in jobs] == [ids[n] for n in range(2)]
    array = ids[0].split("_")[0]
    assert f"submitted 2 jobs to Slurm as array {array}" in result.stdout
    assert "Sweep summary: FINISHED" in result.stdout and "astest: job #" in result.stdout  # or "No clear fastest"
    assert {(j.data.params["model.name"], j.data.params["decode.block_size"]) for j in jobs} == {
        ("tiny_trained", "4"), ("tiny_trained_dense", "4"),
    }  # fmt: skip


def test_scancel_ends_the_run_killed_and_stops_its_worker(
    slurm: SlurmCluster, mlflow_server: MlflowServer, tmp_path: Path, start: Callable[..., subprocess.Popen]
) -> None:
    """And while it ran, `list`, `logs` and the run folder on the shared work dir showed it."""
    process, run_dir = with_worker(start, slurm_args(slurm, mlflow_server, tmp_path, *LONG_DECODE), tmp_path)
    run_id = run_dir.name
    listed = another_terminal("list=true", mlflow_server, tmp_path)
    assert run_id[:8] in listed.stdout, listed.stdout + listed.stderr
    logs = another_terminal(f"logs={run_id}", mlflow_server, tmp_path)
    assert logs.returncode == 0 and "loaded tiny_hybrid" in logs.stdout, logs.stdout + logs.stderr
    job_id = slurm_ids(tmp_path)[0]
    slurm.command("scancel", job_id)
    out, err = finish(process)
    assert process.returncode == 130, out + err
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, (job,) = sweep_runs(client, tmp_path)
    assert (job.info.status, parent.info.status) == ("KILLED", "KILLED")
    assert job.data.tags["error"] == f"cancelled by Slurm (job {job_id} was cancelled: scancel, or an administrator)"
    assert job.data.tags["failure_stage"] == "slurm"
    assert_nothing_left(run_dir)


def test_a_job_past_its_time_limit_fails_with_slurm_time_limit(
    slurm: SlurmCluster, mlflow_server: MlflowServer, tmp_path: Path, start: Callable[..., subprocess.Popen]
) -> None:
    """`--time` of one minute (Slurm enforces it within about 30 s more) on a worker that needs minutes."""
    args = [*slurm_args(slurm, mlflow_server, tmp_path, *LONG_DECODE), "hydra.launcher.timeout_min=1"]
    process, run_dir = with_worker(start, args, tmp_path)
    out, err = finish(process, timeout_s=240)
    assert process.returncode == 1, out + err
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, (job,) = sweep_runs(client, tmp_path)
    assert (job.info.status, parent.info.status) == ("FAILED", "FAILED")
    job_id = slurm_ids(tmp_path)[0]
    assert job.data.tags["error"] == f"Slurm time limit of 00:01:00 reached: job {job_id} stopped, and its worker"
    assert f"Slurm time limit of 00:01:00 reached: job {job_id}" in out
    assert_nothing_left(run_dir)


def test_a_requeued_job_resumes_the_run_it_started(
    slurm: SlurmCluster, mlflow_server: MlflowServer, tmp_path: Path, start: Callable[..., subprocess.Popen]
) -> None:
    """`scontrol requeue`: the job stops its worker and leaves its run; started again, the job starts the worker
    again in that same run (one child run, its log continued), which then finishes with every metric once."""
    process, run_dir = with_worker(start, slurm_args(slurm, mlflow_server, tmp_path, *SHORT_DECODE), tmp_path)
    first_pgid = int((run_dir / PID_FILE).read_text())
    job_id = slurm_ids(tmp_path)[0]
    slurm.command("scontrol", "requeue", job_id)
    wait_for("the requeued job pending", lambda: slurm.job_field(job_id, "JobState") == "PENDING", 60, process)
    assert not group_alive(first_pgid)  # stopped by the job before Slurm let it go
    slurm.command("scontrol", "update", f"jobid={job_id}", "StartTime=now")  # no 2-minute requeue delay
    out, err = finish(process)
    assert process.returncode == 0, out + err
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    assert [j.info.run_id for j in jobs] == [run_dir.name], "a second run was started"
    (job,) = jobs
    assert (job.info.status, parent.info.status) == ("FINISHED", "FINISHED")
    assert job.data.tags["slurm.requeued"] == "1" and job.data.tags["slurm.job_id"] == job_id
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert [e["kind"] for e in events].count("start") == 2 and events[-1]["kind"] == "end"
    methods = client.search_runs([job.info.experiment_id], f"tags.mlflow.parentRunId = '{job.info.run_id}'")
    assert {m.info.run_name for m in methods} == {"ar", "dflash", "ddtree_tb8"}
    for method in methods:
        assert len(client.get_metric_history(method.info.run_id, "tau")) == 1
    assert_nothing_left(run_dir)


def test_ctrl_c_cancels_every_job_the_sweep_submitted(
    slurm: SlurmCluster, mlflow_server: MlflowServer, tmp_path: Path, start: Callable[..., subprocess.Popen]
) -> None:
    """Three jobs that each take every CPU of the node: one runs, two wait in the queue. Ctrl-C scancels all
    three; the running one stops its worker and ends KILLED, the waiting ones are `not started` rows."""
    args = [*LONG_DECODE, "seed=0,1,2", f"hydra.launcher.cpus_per_task={slurm.cpus}"]
    process, run_dir = with_worker(start, slurm_args(slurm, mlflow_server, tmp_path, *args), tmp_path)
    ids = slurm_ids(tmp_path)
    assert sorted(slurm.queue()[i] for i in ids.values()) == ["PENDING", "PENDING", "RUNNING"]
    os.killpg(process.pid, signal.SIGINT)
    out, err = finish(process)
    assert process.returncode == 130, out + err
    # Every job is gone from the queue (one that was running may show COMPLETING for a moment as Slurm ends it).
    deadline = time.monotonic() + 30
    while set(ids.values()) & set(slurm.queue()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not set(ids.values()) & set(slurm.queue()), slurm.queue()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, (job,) = sweep_runs(client, tmp_path)
    assert (job.info.status, parent.info.status) == ("KILLED", "KILLED")
    assert job.data.tags["error"] == "cancelled: the sweep was interrupted (Ctrl-C)"
    waiting = [n for n, i in ids.items() if i != job.data.tags["slurm.job_id"]]
    for number in waiting:
        line = f"not started: the sweep was interrupted (Ctrl-C) (Slurm job {ids[number]} cancelled)"
        assert f"job #{number} KILLED" in out and line in out
    assert_nothing_left(run_dir)


def test_cancel_of_a_run_a_slurm_job_follows_ends_it_cancelled_by_the_user(
    slurm: SlurmCluster, mlflow_server: MlflowServer, tmp_path: Path, start: Callable[..., subprocess.Popen]
) -> None:
    """`cancel=<run>` from another terminal: the mark, then scancel; the job stops its worker and ends the run."""
    process, run_dir = with_worker(start, slurm_args(slurm, mlflow_server, tmp_path, *LONG_DECODE), tmp_path)
    job_id = slurm_ids(tmp_path)[0]
    cancelled = another_terminal(f"cancel={run_dir.name}", mlflow_server, tmp_path)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert f"cancelled {run_dir.name}: Slurm job {job_id} CANCELLED; the run ended KILLED" in cancelled.stdout
    out, err = finish(process)
    assert process.returncode == 130, out + err
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    _, (job,) = sweep_runs(client, tmp_path)
    assert (job.info.status, job.data.tags["error"], job.data.tags["failure_stage"]) == (
        "KILLED", "cancelled by the user", "cancel",
    )  # fmt: skip
    assert_nothing_left(run_dir)
