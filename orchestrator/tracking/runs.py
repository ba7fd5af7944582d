"""The job's MLflow run: created before anything starts on the host, finished with the job's status."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from mlflow.entities import Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from orchestrator.gitinfo import GitInfo
from orchestrator.redaction import redact, redact_url, to_params

# Not an MLflow status: the host stayed out of reach, the run stays RUNNING and can be attached to later.
DETACHED = "DETACHED"
# The exit code of `python -m orchestrator` for each outcome.
EXIT_CODES = {"FINISHED": 0, "FAILED": 1, "KILLED": 130, DETACHED: 75}


def connect(tracking: dict[str, Any]) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking["uri"])


def ensure_experiment(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    existing = client.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    location = f"{Path(artifact_root).as_uri()}/{name}" if artifact_root else None
    return client.create_experiment(name, artifact_location=location)


def run_name(config: dict[str, Any]) -> str:
    return f"{config['host']['name']}-{config['model']['name']}-{time.strftime('%m%d-%H%M%S')}"


def create_job_run(
    client: MlflowClient,
    config: dict[str, Any],
    overrides: Sequence[str],
    git: GitInfo,
    extra_tags: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """Create the job's run with its tags, params and config artifacts; return (experiment id, run id).

    `extra_tags` place a sweep's job under the sweep's parent run."""
    experiment_id = ensure_experiment(client, config["experiment"]["name"], config["tracking"].get("artifact_root"))
    tags = {
        "host": config["host"]["name"],
        "model": config["model"]["name"],
        "git.commit": git.commit,
        "git.dirty": str(git.dirty).lower(),
        "mlflow.source.git.commit": git.commit,
        "hydra.overrides": redact_url(" ".join(overrides)) or "(none)",
        **(extra_tags or {}),
    }
    run = client.create_run(experiment_id, run_name=run_name(config), tags=tags)
    run_id = run.info.run_id
    params = [Param(k, v) for k, v in to_params(config, MAX_PARAM_VAL_LENGTH).items()]
    for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH])
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(yaml.safe_dump(redact(config), sort_keys=False), encoding="utf-8")
        client.log_artifact(run_id, str(config_file))
        if git.diff:
            diff_file = Path(tmp) / "git.diff"
            diff_file.write_text(git.diff, encoding="utf-8")
            client.log_artifact(run_id, str(diff_file))
    return experiment_id, run_id


def fail_before_start(client: MlflowClient, run_id: str, stage: str, error: str) -> None:
    """Mark a run FAILED that never reached the worker (launch, preflight)."""
    client.log_batch(run_id, tags=[RunTag("failure_stage", stage), RunTag("error", error)])
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))


def finish(client: MlflowClient, run_ids: Sequence[str], status: str) -> None:
    for run_id in run_ids:
        client.set_terminated(run_id, status)


LOCAL_UI = "http://127.0.0.1:5000"  # where `make ui` serves a local store


def run_url(client: MlflowClient, experiment_id: str, run_id: str) -> str:
    uri = client.tracking_uri
    base = redact_url(uri.rstrip("/")) if uri.startswith("http") else LOCAL_UI
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
