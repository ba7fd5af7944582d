"""A sweep run again resumes: a job whose settings already FINISHED is not decoded again (`sweep.resume`).

Every job run carries `orchestrator.config_hash`, the digest of what decides its figures
(`tracking/settings_digest.py`: the worker's settings, the seed and the prompt set's text).

A run found by its tag is a claim, not a proof (a tracking server without authentication lets anyone set
any tag): it is reused only when it FINISHED, is a job run, its own params — which MLflow never lets anyone
change once logged — hold every one of this job's settings, value for value, and its signature verifies under
this user's key (`tracking/signing.py`): a whole run forged on an open store, params and all, is decoded
again, and the job's line says why. The same check holds wherever a reused run is named (`why_not`): a
`sweep.reused.<job>` tag on a sweep's parent is a claim too.

A two-phase job stopped in phase 2 (Ctrl-C, a preemption, a crash) has no FINISHED run, but its phase 1 — most of
its GPU time — is whole in its `phase_1.json` (`remote_worker.experiments.phase_one_state`). Where no FINISHED
run stands for the job, the newest KILLED or FAILED job run with the same settings whose phase 1 carries this
user's signature over the very bytes MLflow holds (`find_phase_1`) hands that file to the job's new run, which
decodes phase 2 only; the new run names the old one (`orchestrator.phase_1_from`).

The new sweep's parent run records each reused job as `sweep.reused.<job>` = the run's id, so its page
covers the jobs decoded before and now (`rows.sweep_rows`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from orchestrator.tracking import tags
from orchestrator.tracking.settings_digest import config_hash
from orchestrator.tracking.signing import phase_1_problem, unsigned_reason
from remote_worker.decoding.two_phase import PHASE_1_FILE


@dataclass(frozen=True)
class Reusable:
    run_id: str
    name: str


@dataclass(frozen=True)
class Lookup:
    """What resume found: a run to reuse, or None and, where a candidate was turned down, why."""

    found: Reusable | None
    refused: str | None = None  # `run <id> <why>`, for the job's line


def why_not(run: Run, expected: Mapping[str, str], client: MlflowClient, key: bytes) -> str | None:
    """Why a run named as this job's (by its digest, or by a sweep's reused tag) cannot stand for it (None: it
    can). `expected`: the job's settings ({} where only the run's own kind and signature are checked)."""
    if run.info.status != "FINISHED":
        return f"it is {run.info.status}"
    return _other_job(run, expected) or unsigned_reason(client, run, key)


def _other_job(run: Run, expected: Mapping[str, str]) -> str | None:
    """Why `run` is not a job run of these settings (its params, which no one can change once logged)."""
    if run.data.tags.get(tags.ROLE, "job") != "job" or tags.SCOPE in run.data.tags:
        return "it is not a job run"
    differing = sorted(k for k, v in expected.items() if run.data.params.get(k) != v)
    if differing:
        return f"its params differ ({', '.join(differing[:3])}{', …' if len(differing) > 3 else ''})"
    return None


def find_finished(client: MlflowClient, experiment_id: str, expected: Mapping[str, str], key: bytes) -> Lookup:
    """The newest FINISHED job run of the experiment with these settings that this user's orchestrator signed."""
    digest = config_hash(expected)
    query = f"tags.`{tags.CONFIG_HASH}` = '{digest}' and attributes.status = 'FINISHED'"
    refused = None
    for run in client.search_runs([experiment_id], query, max_results=50, order_by=["attributes.start_time DESC"]):
        reason = why_not(run, expected, client, key)
        if reason is None:
            return Lookup(Reusable(run.info.run_id, run.info.run_name or run.info.run_id), refused)
        refused = refused or f"run {run.info.run_id}: {reason}"
    return Lookup(None, refused)


@dataclass(frozen=True)
class HandedPhase1:
    """An earlier run's phase 1 that a job's new run goes on from: the run, how it ended, the file's bytes (the
    very bytes whose signature was checked, so nothing can change between the check and the hand-over)."""

    run_id: str
    status: str
    data: bytes


@dataclass(frozen=True)
class Phase1Lookup:
    found: HandedPhase1 | None
    refused: str | None = None  # `run <id>: <why>` for the newest candidate turned down


STOPPED = ("KILLED", "FAILED")  # a run that ended in phase 2; a RUNNING one may still be decoding it


def find_phase_1(client: MlflowClient, experiment_id: str, expected: Mapping[str, str], key: bytes) -> Phase1Lookup:
    """The newest stopped job run of the experiment with these settings whose phase 1 this user's orchestrator
    signed (the module's)."""
    digest = config_hash(expected)
    query = f"tags.`{tags.CONFIG_HASH}` = '{digest}'"
    refused = None
    for run in client.search_runs([experiment_id], query, max_results=50, order_by=["attributes.start_time DESC"]):
        if run.info.status not in STOPPED or tags.PHASE_1_SIGNATURE not in run.data.tags:
            continue
        reason = _other_job(run, expected)
        data = None
        if reason is None:
            data = _phase_1_bytes(client, run.info.run_id)
            reason = "its phase 1 cannot be read" if data is None else phase_1_problem(run, digest, data, key)
        if reason is None and data is not None:
            return Phase1Lookup(HandedPhase1(run.info.run_id, run.info.status, data), refused)
        refused = refused or f"run {run.info.run_id}: {reason}"
    return Phase1Lookup(None, refused)


def _phase_1_bytes(client: MlflowClient, run_id: str) -> bytes | None:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return Path(client.download_artifacts(run_id, PHASE_1_FILE, tmp)).read_bytes()
        except (MlflowException, OSError):
            return None


def reused_tag(job: int) -> str:
    return f"{tags.SWEEP_REUSED_PREFIX}{job}"


def reused_jobs(parent: Run) -> dict[int, str]:
    """The jobs a sweep took from earlier runs (`sweep.reused.<job>` tags on its parent): job → run id."""
    found = {}
    for key, value in parent.data.tags.items():
        number = key.removeprefix(tags.SWEEP_REUSED_PREFIX)
        if key.startswith(tags.SWEEP_REUSED_PREFIX) and number.isdigit() and value.isalnum():
            found[int(number)] = value
    return found


@dataclass(frozen=True)
class ReusedRuns:
    """A sweep's `sweep.reused.<job>` tags, checked: what may stand for each job, and why the rest may not."""

    accepted: dict[int, Run]  # job -> the earlier run taken for it
    refused: dict[int, str]  # job -> `the run named as reused (<id>) <why>`


def checked_reused(client: MlflowClient, parent: Run, key: bytes | None) -> ReusedRuns:
    """Every run the sweep's parent names as reused, through the checks resume applies (`why_not`, its signature
    under `key`; None: no key, nothing accepted): the tags are claims anyone may write on the parent, so the
    page shows only what passes as the sweep's (the progress line counts the jobs' own notes instead,
    `Sweep.reused_here`: it runs at every job's end, and this check downloads each named run's files)."""
    accepted: dict[int, Run] = {}
    refused: dict[int, str] = {}
    for number, run_id in reused_jobs(parent).items():
        try:
            earlier = client.get_run(run_id)
        except MlflowException:
            earlier = None
        if earlier is None:
            why = "is gone"
        elif earlier.info.experiment_id != parent.info.experiment_id:
            why = "is in another experiment"
        elif key is None:
            why = "cannot be checked here (no signing key)"
        else:
            reason = why_not(earlier, {}, client, key)
            why = None if reason is None else f"is refused: {reason}"
        if why is None:
            accepted[number] = earlier
        else:
            refused[number] = f"the run named as reused ({run_id}) {why}"
    return ReusedRuns(accepted, refused)
