"""`cancel=<run>`: stop a run's worker once its host proves it the run's, apply what it wrote last, end the run,
and say what happened after it happened.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from rich.console import Console

from orchestrator.cli import context
from orchestrator.cli.context import TransportFactory
from orchestrator.cli.following import follow_run
from orchestrator.cli.picked_up import RunEnded, attached_state, proven, reach
from orchestrator.config.commands import cancel_command as cancel_command_text
from orchestrator.config.settings import JobConfig
from orchestrator.host.launch import stop_worker
from orchestrator.host.proof import NotProven
from orchestrator.host.run_folder import WorkerStatus, worker_status
from orchestrator.host.transport import CONNECTION_ERRORS, Transport
from orchestrator.lifecycle.errors import Interrupted
from orchestrator.lifecycle.job import CANCELLED_BY_USER, Job
from orchestrator.lifecycle.phases import (
    check_resume_point,
    conclude,
    follow,
    open_host,
    request_cancel,
)
from orchestrator.stream.state import StreamState
from orchestrator.sweep.slurm import (
    STOP_GRACE_S,
    settled_state,
    slurm_job_problem,
)
from orchestrator.tracking.client import TrackingUnavailable, outages_named
from orchestrator.tracking.status import Outcome, RunStatus


def command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """Stop a run's worker (SIGTERM, then SIGKILL), apply what it wrote last, end the run KILLED; say what
    happened, once it has happened."""
    client = context.open_tracking(config.tracking)
    store = context.open_state(config)
    try:
        found = attached_state(client, store, config, console)
    except RunEnded as ended:  # nothing to stop: say so, as done (the run is not running, as asked)
        console.print(f"{ended}; nothing was cancelled", markup=False, highlight=False)
        return 0
    state = found.state
    transport = transport_for(config)
    if (code := reach(config, transport)) is not None or (code := proven(config, transport, found)) is not None:
        return code
    if found.slurm_job is not None:  # its follower is a Slurm job, maybe on another node: Slurm stops it
        return _cancel_slurm_job(config, console, client, transport, state, found.slurm_job)
    if store.lock(state.run_id) is None:  # someone follows it: stop the worker, the follower ends the run
        return _stop_followed(config, console, transport, state, store.holder(state.run_id))
    # (the lock is let go by follow_run, when this command is done with the run)
    return follow_run(
        config, console, client, store, transport, found.experiment_id, state, cancel_body, None, model=found.model
    )


def _stop_followed(config: JobConfig, console: Console, transport: Transport, state: StreamState, pid: str) -> int:
    """Another orchestrator follows the run: mark it cancelled and stop its worker; the follower reads the
    mark and ends the run KILLED as cancelled by the user (not as a worker that died)."""
    try:
        transport.open()
        before = mark_cancelled(transport, state.run_dir)
        final = stop_worker(transport, state.run_dir, config.orchestrator.kill_grace_s) if before.alive else before
    except NotProven as refused:
        print(f"{config.host.name}: {refused}; nothing was changed", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    except Exception as exc:  # noqa: BLE001 - one line, as every command's connect failure
        print(f"{config.host.name}: {exc}", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    finally:
        transport.close()
    follower = f"the orchestrator following it (pid {pid})"
    if not before.alive:
        console.print(f"{state.run_id}: its worker had already ended ({before.describe()}); {follower} records its end")
    elif final.alive:
        print(f"{config.host.name}: the worker of {state.run_id} did not stop ({final.describe()})", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    else:
        console.print(f"cancelled {state.run_id}: worker stopped; {follower} ends the run KILLED ({CANCELLED_BY_USER})")
    return 0


def _cancel_slurm_job(
    config: JobConfig, console: Console, client: MlflowClient, transport: Transport, state: StreamState, job: str
) -> int:
    """A run a Slurm job follows: leave the cancel mark, then `scancel` the job, only once Slurm shows it is this
    user's job and carries the run id (`sweep/slurm.py`). The job stops the worker (on its own node: a pid
    means nothing on this machine) and ends the run KILLED; this command says what Slurm and the run did."""
    refusal = slurm_job_problem(job, state.run_id)
    if refusal is not None:
        transport.close()
        print(f"cancel: {refusal}; nothing was cancelled", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    try:
        request_cancel(transport, state.run_dir)
    except Exception as exc:  # noqa: BLE001 - one line, as every command's connect failure
        print(f"{config.host.name}: {exc}", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    finally:
        transport.close()
    done = subprocess.run(["scancel", "--", job], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        print(f"scancel {job}: {done.stderr.strip() or f'exit code {done.returncode}'}", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    ended = _await_end(client, state.run_id, config.orchestrator.kill_grace_s + STOP_GRACE_S + 30)
    slurm_said = settled_state(job)
    if ended is None:
        print(f"scancel {job} returned, Slurm says {slurm_said}, but run {state.run_id} is still RUNNING in MLflow; "
              f"`{cancel_command_text(config, state.run_id)}` again, or look at the job", file=sys.stderr)  # fmt: skip
        return RunStatus.FAILED.exit_code
    verb = "cancelled" if ended == "KILLED" else f"{state.run_id} ended {ended} before the cancel reached it:"
    console.print(f"{verb} {state.run_id}: Slurm job {job} {slurm_said}; the run ended {ended}")
    return 0


def _await_end(client: MlflowClient, run_id: str, timeout_s: float) -> str | None:
    """The run's status once it has ended, waiting up to `timeout_s`; None if it is still running then."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(MlflowException, TrackingUnavailable), outages_named():
            status = client.get_run(run_id).info.status
            if status != "RUNNING":
                return str(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(1.0)


def mark_cancelled(transport: Transport, run_dir: str) -> WorkerStatus:
    """Leave the cancel mark in the run folder if the worker is still there to stop (a worker that had ended
    or died on its own keeps that end); return the worker's status as found."""
    status = worker_status(transport, run_dir)
    if status.alive:
        request_cancel(transport, run_dir)
    return status


def cancel_body(job: Job) -> Outcome:
    """Stop the worker if it still runs (the lifecycle's stop, on `Interrupted`); a worker that had already
    ended keeps its end, which this command records and names as such."""
    open_host(job, leave_if_unreachable=True)
    job.launched = True
    check_resume_point(job)
    try:
        before = mark_cancelled(job.transport, job.state.run_dir)
    except CONNECTION_ERRORS:  # the mark is for a later attach; this command stops and ends the run
        before = WorkerStatus("running")
    if before.alive:
        raise Interrupted(CANCELLED_BY_USER)
    job.found_ended = True
    return conclude(job, follow(job))
