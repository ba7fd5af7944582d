"""Secrets given on the command line reach the worker and nowhere else: not MLflow, not Hydra's files, not `ps`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import JobPaths, MlflowServer, group_alive, run_orchestrator
from tests.test_tracking_outage import paced_python

pytestmark = pytest.mark.slow

TOKEN = "hf_e2e_token_7Qx"
PASSWORD = "pw_e2e_9Zk"
API_KEY = "key_e2e_3Lm"


def command_lines() -> list[str]:
    """Every process's command line on this machine (the host, for host=local)."""
    lines = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return lines


def files_under(folder: Path) -> dict[Path, str]:
    return {p: p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file()}


def test_secrets_stay_out_of_mlflow_hydra_files_and_the_process_list(
    mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path
) -> None:
    host, port = mlflow_server.uri.removeprefix("http://").split(":")
    uri = f"http://alice:{PASSWORD}@{host}:{port}"  # the server ignores the credentials
    args = [
        "tracking=server",
        f"tracking.uri={uri}",
        "experiment=probe",
        f"host.python={paced_python(tmp_path)}",
        f"+host.env.HF_TOKEN={TOKEN}",
        f"+host.env.WANDB_API_KEY={API_KEY}",
        "+host.env.ROUNDS=400",
        "+host.env.PAUSE=0.05",
        "detach=true",
        *job_paths.overrides(),
    ]
    launched = run_orchestrator(args, tmp_path)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    run_dir = job_paths.run_dirs()[0]
    run_id = run_dir.name
    pgid = int((run_dir / "pid").read_text())
    try:
        assert group_alive(pgid)
        time.sleep(0.5)
        leaks = [line for line in command_lines() if TOKEN in line or API_KEY in line or PASSWORD in line]
        assert leaks == []  # the worker runs with them, but no command line carries them
        assert not (run_dir / "worker.env").exists()
    finally:
        elsewhere = tmp_path / "cancel"  # its own Hydra folder, so the launch's stays to be read below
        elsewhere.mkdir()
        cancelled = run_orchestrator(
            ["tracking=server", f"tracking.uri={uri}", f"cancel={run_id}", *job_paths.overrides()], elsewhere
        )
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert not group_alive(pgid)

    printed = launched.stdout + launched.stderr + cancelled.stdout + cancelled.stderr
    for secret in (TOKEN, PASSWORD, API_KEY):
        assert secret not in printed
        for path, text in {**files_under(tmp_path / "hydra"), **files_under(tmp_path / "cancel")}.items():
            assert secret not in text, path
    assert "HF_TOKEN=***" in (tmp_path / "hydra" / ".hydra" / "overrides.yaml").read_text()

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(run_id)
    everything = " ".join([*run.data.params.values(), *run.data.tags.values()])
    local = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / "artifacts")))
    everything += local.read_text()
    for secret in (TOKEN, PASSWORD, API_KEY):
        assert secret not in everything
    assert run.data.params["host.env.HF_TOKEN"] == "***"
