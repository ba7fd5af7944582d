"""Hydra multiruns: one MLflow parent run per sweep, every job a child, a summary; parallel launchers,
GPU leases across concurrent jobs, and what a failed job does to the others."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from orchestrator import PROJECT_ROOT
from orchestrator.host.run_folder import LEASE_FILE, PID_FILE
from tests.conftest import MlflowServer, group_alive, run_orchestrator, start_orchestrator
from tests.sshd import SSHServer
from tests.test_launch import assert_never_shared

pytestmark = pytest.mark.slow

# node costs off: these tests are about the sweep, and the node-cost probe is proven end to end in test_end_to_end
SHORT_DECODE = (
    "experiment.num_prompts=1",
    "decode.max_new_tokens=8",
    "decode.tree_budgets=[4,8]",
    "decode.node_costs=false",
)


def sweep_args(args: list[str], mlflow_server: MlflowServer, tmp_path: Path) -> list[str]:
    paths = (
        f"host.workdir={tmp_path / 'work'}",
        f"orchestrator.state_dir={tmp_path / 'state'}",
        "host.gpu_lock_dir=" + str(tmp_path / "locks"),
        "tracking=server",
        f"tracking.uri={mlflow_server.uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    return ["--multirun", *args, *paths]


def run_sweep(args: list[str], mlflow_server: MlflowServer, tmp_path: Path) -> subprocess.CompletedProcess:
    return run_orchestrator(sweep_args(args, mlflow_server, tmp_path), tmp_path, timeout=600)


def sweep_runs(client: MlflowClient, tmp_path: Path) -> tuple[Run, list[Run]]:
    """The sweep's parent run and its job runs, by job number."""
    parent_id = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["parent_run_id"]
    parent = client.get_run(parent_id)
    experiments = [e.experiment_id for e in client.search_experiments()]
    jobs = client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent_id}'")
    return parent, sorted(jobs, key=lambda r: int(r.data.tags["sweep.job"]))


def summary_csv(client: MlflowClient, parent: Run, tmp_path: Path) -> list[dict[str, str]]:
    local = client.download_artifacts(parent.info.run_id, "sweep_summary.csv", str(tmp_path))
    return list(csv.DictReader(io.StringIO(Path(local).read_text())))


def test_a_parallel_sweep_is_one_parent_run_with_a_child_per_job(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    args = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model=tiny_hybrid,tiny_dense"]
    result = run_sweep([*args, "decode.temperature=0,1", *SHORT_DECODE], mlflow_server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["sweep.launcher"] == "joblib"
    assert [j.data.tags["sweep.job"] for j in jobs] == ["0", "1", "2", "3"]
    assert all(j.info.status == "FINISHED" for j in jobs)
    grid = {(j.data.params["model.name"], j.data.params["decode.temperature"]) for j in jobs}
    assert grid == {("tiny_hybrid", "0"), ("tiny_hybrid", "1"), ("tiny_dense", "0"), ("tiny_dense", "1")}
    for job in jobs:  # each job keeps its own method runs under it
        methods = client.search_runs([job.info.experiment_id], f"tags.mlflow.parentRunId = '{job.info.run_id}'")
        assert {m.info.run_name for m in methods} == {"ar", "dflash", "ddtree_tb4", "ddtree_tb8"}
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"sweep_summary.csv", "sweep_summary.md", "plots"} <= artifacts
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "plots")] == [
        "plots/sweep_tau_speedup_vs_budget.png"
    ]
    rows = summary_csv(client, parent, tmp_path)
    assert len(rows) == 4 * 4  # four jobs, four methods each
    lossless = [r["lossless"] for r in rows if r["overrides"].split().count("decode.temperature=0")]
    assert lossless and all(float(v) == 1.0 for v in lossless)
    assert "Sweep summary: FINISHED" in result.stdout
    assert "4 jobs, each a child run" in result.stdout
    said = result.stdout + result.stderr  # Hydra's own `#0 : <every override>` lines repeat the sweep's: not shown
    assert "[HYDRA]" not in said and "Creating initial MLflow database tables" not in said
    names = sorted(j.info.run_name.split(" · ")[0] for j in jobs)  # what the sweep varies, in each name
    assert names == ["T=0 tiny_dense", "T=0 tiny_hybrid", "T=1 tiny_dense", "T=1 tiny_hybrid"]
    # The parent's own page: what it varies in its name, the answer and the table as its description, the grid.
    assert parent.info.run_name.startswith("sweep of model × temperature · 4 jobs · ")
    note = parent.data.tags["mlflow.note.content"].splitlines()
    assert note[0] == "**Sweep FINISHED: 4 of 4 jobs finished** · varies model, temperature"
    assert note[2].startswith(("Fastest: job #", "No clear fastest: job #")) and len(note) == 6 + 4 * 4
    assert parent.data.params["grid.model"] == "tiny_hybrid,tiny_dense"
    assert parent.data.params["grid.decode.temperature"] == "0,1"
    assert "job0.ddtree_tb8.tau" in parent.data.metrics
    url = f"sweep run: {mlflow_server.uri}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
    url += "?workflowType=machine_learning"
    assert result.stdout.count(url) == 2  # at its start and at its end


def test_concurrent_jobs_never_share_a_gpu_slot(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """Two GPU slots, four jobs at once: the worker-recorded lease intervals never overlap on a slot."""
    args = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=4", "experiment=probe", "seed=0,1,2,3"]
    result = run_sweep([*args, "host.gpus=[0,1]", "model.device=cpu"], mlflow_server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    assert len(jobs) == 4 and parent.info.status == "FINISHED"
    worker_intervals, lease_intervals = [], []
    for job in jobs:
        run_dir = tmp_path / "work" / "runs" / job.info.run_id
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        start, end = events[0], events[-1]
        assert (start["kind"], end["kind"]) == ("start", "end")
        gpu = start["data"]["cuda_visible_devices"]
        assert job.data.tags["worker.gpu"] == gpu
        worker_intervals.append((gpu, start["t"], end["t"]))
        lease_gpu, lease_start, lease_end = (run_dir / LEASE_FILE).read_text().split()
        assert lease_gpu == gpu
        lease_intervals.append((gpu, float(lease_start), float(lease_end)))
    assert_never_shared(worker_intervals)
    assert_never_shared(lease_intervals)
    assert {gpu for gpu, _, _ in worker_intervals} == {"0", "1"}
    assert "waiting for one to be free" in result.stdout


def test_a_submitit_local_sweep_lands_in_mlflow_the_same_way(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    args = ["hydra/launcher=submitit_local", "experiment=probe", "model=tiny_hybrid,tiny_dense"]
    result = run_sweep(args, mlflow_server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.launcher"] == "submitit_local"
    assert [(j.data.params["model.name"], j.info.status) for j in jobs] == [
        ("tiny_hybrid", "FINISHED"),
        ("tiny_dense", "FINISHED"),
    ]
    assert jobs[0].data.params["probe.model.class"] == "Qwen3_5ForCausalLM"
    assert {r["status"] for r in summary_csv(client, parent, tmp_path)} == {"FINISHED"}


def test_jobs_spread_over_a_pool_of_hosts(sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """sweep.hosts=[test_local, test_sshd] (this machine, and it again over SSH, each with its own folders as two
    machines would have; no GPU to lease): each job takes the host with the fewest jobs running or just claimed
    there, ties in pool order, so one after the other they alternate; one parent run."""
    conf = tmp_path / "conf" / "host"
    conf.mkdir(parents=True)
    local = {
        **yaml.safe_load((PROJECT_ROOT / "conf" / "host" / "local.yaml").read_text()),
        "name": "test_local",
        "workdir": str(tmp_path / "local"),
        "gpu_lock_dir": str(tmp_path / "local-locks"),
    }
    host = {
        **yaml.safe_load((PROJECT_ROOT / "conf" / "host" / "localhost_ssh.yaml").read_text()),
        "name": "test_sshd",
        "hostname": sshd.address,
        "port": sshd.port,
        "user": sshd.user,
        "identity_file": str(sshd.client_key),
        "known_hosts": str(sshd.known_hosts),
        "python": sys.executable,
        "workdir": str(tmp_path / "work"),
        "gpu_lock_dir": str(tmp_path / "locks"),
    }
    (conf / "test_local.yaml").write_text(yaml.safe_dump(local))
    (conf / "test_sshd.yaml").write_text(yaml.safe_dump(host))
    args = [
        "--multirun",
        "experiment=probe",
        "seed=0,1,2",
        "host.gpus=none",
        "sweep.hosts=[test_local,test_sshd]",
        f"hydra.searchpath=[file://{conf.parent}]",
        f"orchestrator.state_dir={tmp_path / 'state'}",
        "tracking=server",
        f"tracking.uri={mlflow_server.uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    result = run_orchestrator(args, tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    assert [(j.data.tags["host"], j.info.status) for j in jobs] == [
        ("test_local", "FINISHED"),
        ("test_sshd", "FINISHED"),
        ("test_local", "FINISHED"),
    ]
    assert parent.info.status == "FINISHED"
    assert (tmp_path / "work" / "code").is_dir(), "the SSH job synced a code snapshot"


FAILING = "model.path=/no/such/model"  # with model.source=pretrained: the preflight fails, fast


def test_a_failed_job_or_a_bad_config_does_not_stop_the_others(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """Job #0's host check fails and jobs #1 and #3 are refused by the config check (`probe.tree_size=0`): none
    stops job #2, which runs and finishes; each of the others is a failed row of the summary with its reason,
    not a gap. (One sweep for what the failed-job and the bad-config tests proved with a sweep each.)"""
    args = ["experiment=probe", "model=tiny_hybrid", "model.source=pretrained,config", "probe.tree_size=4,0", FAILING]
    result = run_sweep(args, mlflow_server, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    assert [(j.data.tags["sweep.job"], j.info.status) for j in jobs] == [("0", "FAILED"), ("2", "FINISHED")]
    assert parent.info.status == "FAILED"
    error = "local: model.path /no/such/model is missing or has no config.json"
    assert jobs[0].data.tags["error"] == error
    rows = summary_csv(client, parent, tmp_path)
    statuses = [(r["job"], r["status"]) for r in rows]
    assert statuses == [("0", "FAILED"), ("1", "FAILED"), ("2", "FINISHED"), ("3", "FAILED")]
    refused = "config error: probe.tree_size=0 must be an integer >= 1"
    assert [r["error"] for r in rows] == [error, refused, "", refused]
    said = " ".join(result.stdout.split())
    assert "job #0 FAILED (model.source=pretrained" in said and error in said


def test_ctrl_c_stops_every_job_of_a_parallel_sweep(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    long_decode = ("experiment.num_prompts=3", "decode.max_new_tokens=1500", "decode.tree_budgets=[4]")
    args = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1,2", *long_decode]
    process = start_orchestrator(sweep_args(args, mlflow_server, tmp_path), tmp_path, own_group=True)
    try:
        deadline = time.monotonic() + 180
        while len(list((tmp_path / "work" / "runs").glob("*/pid"))) < 2:  # both running jobs have a worker
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, stdout + stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    assert parent.info.status == "KILLED"
    assert [j.info.status for j in jobs] == ["KILLED"] * 3
    # A running job hears the Ctrl-C itself, or first sees the sweep cancelled by the launching process.
    stopped = {"interrupted by the user (Ctrl-C)", "cancelled: the sweep was interrupted (Ctrl-C)"}
    assert {jobs[0].data.tags["error"], jobs[1].data.tags["error"]} <= stopped
    assert jobs[2].data.tags["error"] == "not started: the sweep was interrupted (Ctrl-C)"
    for pid_file in (tmp_path / "work" / "runs").glob("*/pid"):
        assert not group_alive(int(pid_file.read_text())), "no worker survives the Ctrl-C"


def test_fail_fast_stops_the_running_jobs_and_skips_the_rest(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """Job 0 decodes for long; job 1 fails at once: job 0's worker is stopped, jobs 2 and 3 never start."""
    long_decode = ("experiment.num_prompts=3", "decode.max_new_tokens=1500", "decode.tree_budgets=[4]")
    args = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "sweep.fail_fast=true"]
    args += ["seed=0,1", "model=tiny_hybrid", "model.source=config,pretrained", FAILING, *long_decode]
    result = run_sweep(args, mlflow_server, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent, jobs = sweep_runs(client, tmp_path)
    swept = [
        [o for o in j.data.tags["hydra.overrides"].split() if o.startswith(("seed", "model.source"))] for j in jobs
    ]
    assert swept == [
        ["seed=0", "model.source=config"],
        ["seed=0", "model.source=pretrained"],
        ["seed=1", "model.source=config"],
        ["seed=1", "model.source=pretrained"],
    ]
    statuses = {j.data.tags["sweep.job"]: (j.info.status, j.data.tags.get("error", "")) for j in jobs}
    assert statuses["1"][0] == "FAILED"
    for job in ("2", "3"):
        assert statuses[job][0] == "KILLED" and statuses[job][1].startswith("not started: job #1 failed")
    assert parent.info.status == "FAILED"
    # Job 0 may be cancelled before its launch (the sweep is checked between phases; job 1's preflight can fail
    # first on a busy machine): then it was not started and no worker ran; if it was, it was cancelled and its
    # worker's process group is gone.
    pid_file = tmp_path / "work" / "runs" / jobs[0].info.run_id / PID_FILE
    if pid_file.exists():
        assert statuses["0"][0] == "KILLED" and statuses["0"][1].startswith("cancelled: job #1 failed")
        assert not group_alive(int(pid_file.read_text())), "the cancelled job's worker is gone"
    else:
        assert statuses["0"][0] == "KILLED" and statuses["0"][1].startswith("not started: job #1 failed")
        assert not (pid_file.parent / "exit_code").exists(), "no pid file: no worker was started"
