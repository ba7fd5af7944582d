"""The job's MLflow run: created before anything starts on the host, ended by one function, `end_run`."""

from __future__ import annotations

import getpass
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from mlflow.entities import Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from orchestrator.config.redaction import overrides_tag, redact, redact_url, to_params
from orchestrator.config.settings import JobConfig
from orchestrator.tracking import tags
from orchestrator.tracking.gitinfo import GitInfo
from orchestrator.tracking.location import location_tags
from orchestrator.tracking.settings_digest import PROMPTS_DIGEST, config_hash
from orchestrator.tracking.status import NOT_STARTED, Outcome, RunStatus, Stage


def ensure_experiment(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    """The experiment's id, created where missing. Its kind is set where nothing set it: a model-development
    experiment (runs, metrics, charts), not a GenAI app's. MLflow 3.17's UI still opens its GenAI view unless
    the address asks otherwise, which `run_url` does."""
    existing = client.get_experiment_by_name(name)
    if existing is not None:
        if tags.EXPERIMENT_KIND not in (getattr(existing, "tags", None) or {}):
            client.set_experiment_tag(existing.experiment_id, tags.EXPERIMENT_KIND, tags.CLASSIC_EXPERIMENT)
        return existing.experiment_id
    location = f"{Path(artifact_root).as_uri()}/{name}" if artifact_root else None
    kind = {tags.EXPERIMENT_KIND: tags.CLASSIC_EXPERIMENT}
    return client.create_experiment(name, artifact_location=location, tags=kind)


def run_name(config: JobConfig, varying: Mapping[str, str] | None = None) -> str:
    """What tells runs apart first, so the UI's truncated column still does: `12-03 05:52 · tiny_trained T=0
    bs=8` for a single run (runs of one experiment are mostly the same settings again: their time is what
    differs; cut to a shared `tiny_trained T=0 · 1…` they could not be told apart); a sweep's job leads with
    the keys the sweep varies (`bs=4 T=0 · tiny_trained · 12-03 05:52` when block size and temperature are
    swept), the shortest first: MLflow's runs table cuts a name at about 16 characters, and a model's long name
    first read `tiny_trained_de…` on four jobs that differed in temperature and block size."""
    fixed = {"model": config.model_name}
    if config.experiment_name == "ddtree_gdn":
        decode = config.worker_sections["decode"]
        fixed["decode.temperature"] = f"T={float(decode.get('temperature', 0)):g}"
        if decode.get("block_size"):
            fixed["decode.block_size"] = f"bs={decode['block_size']}"
    else:
        fixed["experiment"] = config.experiment_name
    varying = dict(varying or {})
    if not varying:
        return f"{time.strftime('%m-%d %H:%M')} · " + " ".join(fixed.values())
    first = sorted((fixed.get(key) or f"{key.rsplit('.', 1)[-1]}={value}" for key, value in varying.items()), key=len)
    rest = [text for key, text in fixed.items() if key not in varying]
    return " · ".join([" ".join(first), *([" ".join(rest)] if rest else []), time.strftime("%m-%d %H:%M")])


@dataclass(frozen=True)
class CreatedRun:
    experiment_id: str
    run_id: str
    name: str


def create_job_run(
    client: MlflowClient,
    config: JobConfig,
    overrides: Sequence[str],
    git: GitInfo,
    extra_tags: Mapping[str, str] | None = None,
    varying: Mapping[str, str] | None = None,
    settings: Mapping[str, str] | None = None,
) -> CreatedRun:
    """Create the job's run with its tags, params and config artifacts.

    `extra_tags` place a sweep's job under the sweep's parent run. The run records who launched it from
    where (`launch.user`, `launch.machine`): for people reading the store, never believed by the tool (`last`
    comes from the launching user's own state folder). `settings` (`sweep.resume.settings_params`) add the
    prompt set's digest to the params and name the run's settings digest in a tag, for a sweep run again."""
    experiment_id = ensure_experiment(client, config.experiment_name, config.tracking.artifact_root)
    run_tags = {
        tags.HOST: config.host.name,
        **location_tags(config.host),
        tags.MODEL: config.model_name,
        tags.GIT_COMMIT: git.commit,
        tags.GIT_DIRTY: str(git.dirty).lower(),
        tags.SOURCE_GIT_COMMIT: git.commit,
        tags.HYDRA_OVERRIDES: overrides_tag(overrides),
        tags.LAUNCH_USER: getpass.getuser(),
        tags.LAUNCH_MACHINE: socket.gethostname(),
        **(extra_tags or {}),
    }
    if settings is not None:
        run_tags[tags.CONFIG_HASH] = config_hash(settings)
    name = run_name(config, varying)
    run = client.create_run(experiment_id, run_name=name, tags=run_tags)
    run_id = run.info.run_id
    flat = to_params(config.resolved, MAX_PARAM_VAL_LENGTH)
    if settings is not None:
        flat[PROMPTS_DIGEST] = settings[PROMPTS_DIGEST]
    params = [Param(k, v) for k, v in flat.items()]
    for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH])
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(yaml.safe_dump(redact(config.resolved), sort_keys=False), encoding="utf-8")
        client.log_artifact(run_id, str(config_file))
        if git.diff:
            diff_file = Path(tmp) / "git.diff"
            diff_file.write_text(git.diff, encoding="utf-8")
            client.log_artifact(run_id, str(diff_file))
    return CreatedRun(experiment_id, run_id, name)


def end_run(
    client: MlflowClient, run_ids: Sequence[str], outcome: Outcome, *, error_already_tagged: bool = False
) -> None:
    """End the job's run (the last of `run_ids`) and its children with the outcome's status.

    A run that did not finish says why: its `error` line and the `failure_stage` it happened in (unless the
    worker's own traceback event has set both already)."""
    assert outcome.status.ends_the_run, outcome
    job_run = run_ids[-1]
    if outcome.error and not error_already_tagged:
        stage = (outcome.stage or Stage.WORKER).value
        client.log_batch(job_run, tags=[RunTag(tags.ERROR, outcome.error[:5000]), RunTag(tags.FAILURE_STAGE, stage)])
    for run_id in run_ids:
        client.set_terminated(run_id, outcome.status.value)


def mark_detached(client: MlflowClient, run_id: str, command: str) -> None:
    """Tag the run as followed by nobody, with the command that follows it again."""
    client.log_batch(run_id, tags=[RunTag(tags.DETACHED, "true"), RunTag(tags.ATTACH_COMMAND, command)])


def end_unstarted_job(client: MlflowClient, run_id: str, reason: str) -> None:
    """A sweep's job cancelled before it began."""
    end_run(client, [run_id], Outcome(RunStatus.KILLED, f"{NOT_STARTED}{reason}", Stage.SWEEP))


LOCAL_UI = "http://127.0.0.1:5000"  # where `make ui` serves a local store
# MLflow 3's UI opens in its GenAI mode unless the address (or the browser's last choice) says otherwise.
CLASSIC_VIEW = "workflowType=machine_learning"


def run_url(client: MlflowClient, experiment_id: str, run_id: str) -> str:
    uri = client.tracking_uri
    base = redact_url(uri.rstrip("/")) if uri.startswith("http") else LOCAL_UI
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{CLASSIC_VIEW}"
