"""Stopping a job's worker: on Ctrl-C, a cancel, a cancelled sweep, or Slurm's signal, and what the run then
records (the worker's own end where it had one).
"""

from __future__ import annotations

import contextlib

from orchestrator.config.commands import cancel_command
from orchestrator.host.launch import stop_worker
from orchestrator.host.proof import NotProven
from orchestrator.host.run_folder import WorkerStatus
from orchestrator.host.transport import (
    CONNECTION_ERRORS,
)
from orchestrator.lifecycle.collect import apply_all
from orchestrator.lifecycle.errors import HostLost
from orchestrator.lifecycle.job import CANCELLED_BY_USER, Job
from orchestrator.lifecycle.phases import cancel_requested, conclude
from orchestrator.sweep.slurm import (
    STOP_GRACE_S,
    SlurmEnd,
    SlurmStopped,
    job_fields,
    time_limit_text,
    why_stopped,
)
from orchestrator.tracking import tags
from orchestrator.tracking.client import outages_named
from orchestrator.tracking.status import Outcome, RunStatus, Stage


def stop(job: Job, reason: str, grace_s: float | None = None) -> Outcome:
    """Ctrl-C, cancel, a cancelled sweep, Slurm: stop the worker and read what it wrote last.

    The end is what the worker recorded: one that had ended on its own (FINISHED or FAILED in its `end`
    event, read now or before) keeps its status; one our SIGTERM stopped ends KILLED with our reason.
    `grace_s`: SIGTERM to SIGKILL; the job's own (a Slurm job's fits Slurm's KillWait), else
    orchestrator.kill_grace_s."""
    grace_s = next((g for g in (grace_s, job.stop_grace_s) if g is not None), job.config.orchestrator.kill_grace_s)
    if job.launched:
        job.live.note(f"[yellow]{reason}: stopping the worker[/yellow]")
        for attempt in (1, 2):  # a dropped connection gets one fresh one: the stop must not give up lightly
            try:
                final = stop_worker(job.transport, job.state.run_dir, grace_s)
                job.mirror.pull(job.transport)
                job.mirror.scan()
                break
            except NotProven as refusal:
                raise HostLost(f"{job.host_label}: {refusal}; the run stays RUNNING") from refusal
            except CONNECTION_ERRORS as exc:
                if attempt == 2:
                    raise HostLost(
                        f"{job.host_label}: could not stop the worker ({exc}); stop it later with "
                        f"`{cancel_command(job.config, job.state.run_id)}`"
                    ) from exc
                with contextlib.suppress(*CONNECTION_ERRORS):
                    job.transport.reconnect()
        # SIGKILL did not end its process group: the run is not over, and the command says what lives on.
        if final.state in ("running", "waiting"):
            raise HostLost(
                f"{job.host_label}: the worker of {job.state.run_id[:8]} did not stop ({final.describe()}, pid "
                f"{final.pid}); stop it with `{cancel_command(job.config, job.state.run_id)}`"
            )
        if job.mirror.end is not None:
            recorded = conclude(job, WorkerStatus("exited"))
            if recorded.status is not RunStatus.KILLED:
                return recorded
    return Outcome(RunStatus.KILLED, reason, Stage.CANCEL)


def slurm_stop(job: Job, stopped: SlurmStopped) -> Outcome:
    """Slurm is stopping the job: stop the worker within Slurm's KillWait and end the run as Slurm meant it
    (`sweep/slurm.py`): scancel → KILLED, the time limit → FAILED, a requeue → left RUNNING for the job
    Slurm starts again, which resumes it. A sweep cancelled meanwhile (Ctrl-C scancels its jobs) keeps its
    own reason, and a worker that had ended on its own keeps its end."""
    fields = job_fields(stopped.job.job_id)
    why = why_stopped(stopped.job, fields)
    said = " ".join(
        f"{key}={fields[key]}" for key in ("JobState", "Reason", "RunTime", "TimeLimit", "Restarts") if key in fields
    )
    job.live.note(f"{stopped}: {why.value} (scontrol: {said or 'no answer'})")
    swept = job.sweep.cancelled() if job.sweep is not None else None
    slurm_job = stopped.job.job_id
    if swept is not None:
        return stop(job, f"cancelled: {swept}", STOP_GRACE_S)
    if cancel_requested(job):  # `cancel=<run>` scancels a Slurm-run run after leaving its mark
        outcome = stop(job, CANCELLED_BY_USER, STOP_GRACE_S)
        killed = outcome.status is RunStatus.KILLED
        return Outcome(RunStatus.KILLED, CANCELLED_BY_USER, Stage.CANCEL) if killed else outcome
    if why is SlurmEnd.REQUEUED:
        reason = f"requeued by Slurm (job {slurm_job}): the job resumes this run when Slurm starts it again"
    elif why is SlurmEnd.TIME_LIMIT:
        reason = f"Slurm time limit{time_limit_text(fields)} reached: job {slurm_job} stopped, and its worker"
    else:
        reason = f"cancelled by Slurm (job {slurm_job} was cancelled: scancel, or an administrator)"
    outcome = stop(job, reason, STOP_GRACE_S)
    if outcome.status is not RunStatus.KILLED or outcome.error != reason:  # it had ended on its own, or `cancel=`
        return outcome
    if why is SlurmEnd.REQUEUED:
        apply_all(job)
        with outages_named():
            job.client.set_tag(job.state.run_id, tags.SLURM_REQUEUED, str(stopped.job.restarts + 1))
        return Outcome(RunStatus.DETACHED, reason, Stage.SLURM)  # left for the job Slurm starts again
    status = RunStatus.FAILED if why is SlurmEnd.TIME_LIMIT else RunStatus.KILLED
    return Outcome(status, reason, Stage.SLURM)
