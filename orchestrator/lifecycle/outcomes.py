"""The one place a job's failures are given their meaning: `lifecycle` runs a command's body, then collects and
finishes whatever happened, and returns how the job ended (`tracking/status.py`).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable

from orchestrator.config.commands import attach_command, cancel_command
from orchestrator.config.redaction import redact_text
from orchestrator.config.settings import Command
from orchestrator.host.launch import stop_worker
from orchestrator.host.proof import NotProven
from orchestrator.host.transport import (
    UnsafePath,
)
from orchestrator.lifecycle.collect import collect, finish
from orchestrator.lifecycle.errors import HostLost, Interrupted, LocalFailure, PhaseFailed
from orchestrator.lifecycle.job import Job
from orchestrator.lifecycle.stopping import slurm_stop, stop
from orchestrator.sweep import SweepCancelled
from orchestrator.sweep.slurm import (
    SlurmStopped,
)
from orchestrator.tracking.client import TrackingUnavailable, outages_named
from orchestrator.tracking.runs import end_run, mark_detached
from orchestrator.tracking.status import NOT_STARTED, Outcome, RunStatus, Stage


def lifecycle(job: Job, body: Callable[[Job], Outcome]) -> Outcome:
    """Run `body`, then collect and finish whatever happened; return how the job ended."""
    try:
        try:
            outcome = body(job)
        except PhaseFailed as exc:
            stop_quietly(job)
            outcome = Outcome(RunStatus.FAILED, exc.message, exc.stage)
        except (UnsafePath, NotProven) as exc:
            outcome = refused(job, exc)
        except SlurmStopped as exc:
            job.stopping()
            job.interrupted = True
            outcome = slurm_stop(job, exc)
        except (KeyboardInterrupt, Interrupted, SweepCancelled) as exc:
            job.stopping()
            job.interrupted = True
            reason = f"cancelled: {exc}" if isinstance(exc, SweepCancelled) else str(exc) or "interrupted (Ctrl-C)"
            if isinstance(exc, SweepCancelled) and not job.launched:  # between the preflight and the launch
                reason = f"{NOT_STARTED}{exc}"
            if isinstance(exc, KeyboardInterrupt):
                reason = "interrupted by the user (Ctrl-C)"
            outcome = stop(job, reason)
        if outcome.status is RunStatus.DETACHED:
            if outcome.stage in (Stage.SLURM, Stage.FOLLOW):  # requeued (resumed by Slurm's next start), or refused
                return outcome
            return leave_for_attach(job, outcome.error or "")
        collect(job, outcome)
        finish(job, outcome)
        return outcome
    except HostLost as exc:
        return leave_for_attach(job, f"{exc}; the run stays RUNNING and its worker goes on if it can")
    except TrackingUnavailable as exc:
        job.tracking_down = True
        what = "has ended" if job.mirror.end is not None or not job.launched else "goes on"
        return leave_for_attach(
            job, f"MLflow unreachable ({exc}); the worker {what}, and `attach` applies what is waiting, exactly once"
        )
    except (KeyboardInterrupt, Interrupted, SweepCancelled, SlurmStopped):
        # A second Ctrl-C while collecting: the events are safe in the local state; attach finishes the run.
        return leave_for_attach(job, "interrupted while finishing the run")
    except Exception as exc:  # noqa: BLE001 - local by elimination: named, the worker stopped, the run ended
        return _local_failure(job, exc)


def refused(job: Job, exc: UnsafePath | NotProven) -> Outcome:
    """The run's folder holds what the safe file layer refuses (a link, not a regular file) or its worker is not
    proven the run's: a run started elsewhere (attach, cancel) is left exactly as it was, with the one line;
    a run this command launched ends FAILED at stage `follow`, its worker stopped if it is proven its own."""
    message = f"{job.host_label}: {exc}"
    if job.config.command in (Command.ATTACH, Command.CANCEL):
        return Outcome(RunStatus.DETACHED, f"{message}; nothing was changed", Stage.FOLLOW)
    stop_quietly(job)
    return Outcome(RunStatus.FAILED, message, Stage.FOLLOW)


def _local_failure(job: Job, exc: Exception) -> Outcome:
    """This machine failed: stop the worker (never orphaned), end the run FAILED at stage `local`; where either
    cannot be done (the host or MLflow is out of reach too), say so and leave the run for attach."""
    if isinstance(exc, LocalFailure):
        message = f"local: {exc}"
    else:
        crash = job.store.dir / f"{job.state.run_id}.crash.txt"
        with contextlib.suppress(OSError, UnsafePath):
            job.store.files.write_whole(crash.name, redact_text(traceback.format_exc()).encode())
        message = f"local: orchestrator error {type(exc).__name__}: {exc} (traceback in {crash})"
    message = redact_text(message)
    if job.launched:
        try:
            stop_worker(job.transport, job.state.run_dir, job.config.orchestrator.kill_grace_s)
        except Exception as stop_error:  # noqa: BLE001 - the host is gone too: the run must stay findable
            detail = f"{message}; the worker could not be stopped ({type(stop_error).__name__})"
            return leave_for_attach(job, f"{detail}: `{cancel_command(job.config, job.state.run_id)}` stops it")
    outcome = Outcome(RunStatus.FAILED, message, Stage.LOCAL)
    try:
        with outages_named():
            end_run(job.client, [*job.state.children.values(), job.state.run_id], outcome)
    except Exception:  # noqa: BLE001 - MLflow cannot take the end now: attach ends the run later
        job.tracking_down = True
        return leave_for_attach(job, f"{message}; MLflow could not record the end")
    return outcome


def leave_for_attach(job: Job, reason: str) -> Outcome:
    """The worker goes on (or has ended) but this process cannot finish the run: say how to pick it up."""
    command = attach_command(job.config, job.state.run_id)
    if not job.tracking_down:
        with contextlib.suppress(TrackingUnavailable, KeyboardInterrupt), outages_named():
            mark_detached(job.client, job.state.run_id, command)
    return Outcome(RunStatus.DETACHED, redact_text(reason))


def stop_quietly(job: Job) -> None:
    if job.launched:
        with contextlib.suppress(Exception):
            stop_worker(job.transport, job.state.run_dir, job.config.orchestrator.kill_grace_s)
