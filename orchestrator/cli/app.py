"""The commands: run (and detach), attach, cancel, list. Each is a short recipe of the phases in `lifecycle/job.py`.

    validate config → open tracking → open state → create (or find) the run → lifecycle(body) → report

What can go wrong before a run exists is one line and an exit code: 2 for a config mistake, 1 for a tracking
store that does not answer or a state folder that cannot be written; nothing is created on the host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from orchestrator.cli.listing import list_runs, print_logs
from orchestrator.cli.run_ref import find_run
from orchestrator.config import host_values
from orchestrator.config.commands import attach_command, carried
from orchestrator.config.commands import cancel_command as cancel_command_text
from orchestrator.config.host_values import run_dir_for
from orchestrator.config.redaction import redact_hydra_outputs, redact_text
from orchestrator.config.settings import Command, JobConfig
from orchestrator.config.text import printable, shown
from orchestrator.config.validation import ConfigError, validate
from orchestrator.host.connect import transport_for
from orchestrator.host.launch import stop_worker
from orchestrator.host.proof import NotProven, prove_folder, prove_worker
from orchestrator.host.run_folder import WorkerStatus, worker_status
from orchestrator.host.transport import CONNECTION_ERRORS, Transport
from orchestrator.lifecycle.display import LiveProgress, summary_table
from orchestrator.lifecycle.errors import HostLost, Interrupted, LocalFailure, PhaseFailed
from orchestrator.lifecycle.interrupt import CtrlC
from orchestrator.lifecycle.job import (
    CANCELLED_BY_USER,
    Job,
    check_resume_point,
    conclude,
    ended_on_its_own,
    follow,
    launch,
    lifecycle,
    open_host,
    preflight,
    relaunch,
    request_cancel,
    sync,
)
from orchestrator.stream.state import Launched, StateStore, StreamState
from orchestrator.sweep import Sweep, assign_host, current_sweep, record_job_error
from orchestrator.sweep.slurm import (
    STOP_GRACE_S,
    SlurmJob,
    SlurmSignals,
    StartedRun,
    current_slurm_job,
    mark_job,
    record_run,
    recorded_run,
    settled_state,
    slurm_job_problem,
)
from orchestrator.tracking import tags
from orchestrator.tracking.client import TrackingUnavailable, open_tracking, outages_named
from orchestrator.tracking.gitinfo import git_info
from orchestrator.tracking.location import located
from orchestrator.tracking.runs import create_job_run, end_unstarted_job, run_url
from orchestrator.tracking.status import CONFIG_ERROR_EXIT, Outcome, RunStatus, Stage

CANNOT_BEGIN_EXIT = 1
TransportFactory = Callable[[JobConfig], Transport]


def make_transport(config: JobConfig) -> Transport:
    """The host's transport (`host/connect.py` picks the kind); tests pass their own factory instead."""
    return transport_for(config.host)


def run_job(cfg: DictConfig) -> int:
    """Validate, then run the command the config asks for; return the exit code (see `tracking/status.py`).

    Nothing escapes to Hydra: its report of a failed job prints every override verbatim, secrets included."""
    try:
        return _run_job(cfg)
    except Exception as exc:  # noqa: BLE001 - the lifecycle handles every run's failures; this is a bug before it
        crash = Path(tempfile.gettempdir()) / f"orchestrator-crash-{os.getpid()}.txt"
        with contextlib.suppress(OSError):
            crash.write_text(redact_text(traceback.format_exc()), encoding="utf-8")
        print(
            f"local: orchestrator error {type(exc).__name__}: {redact_text(str(exc))} (traceback in {crash})",
            file=sys.stderr,
        )
        return CANNOT_BEGIN_EXIT


def _run_job(cfg: DictConfig) -> int:
    _keep_hydra_files_secret()
    console = Console()
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # its errors come back to us as exceptions
    for chatty in ("alembic", "mlflow", "urllib3"):  # a local store's migrations, retries we report ourselves
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        overrides = _task_overrides()
        config = validate(assign_host(cfg))
        printed = carried(overrides, config.resolved)
        config = replace(config, carried=printed)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        record_job_error(f"config error: {exc}")
        return CONFIG_ERROR_EXIT
    return run_config(config, console, make_transport)


def run_config(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """Run the command a checked config asks for; what stops it before a run exists is one line."""
    try:
        return COMMANDS[config.command](config, console, transport_for)
    except (TrackingUnavailable, LocalFailure) as exc:
        print(f"{'tracking' if isinstance(exc, TrackingUnavailable) else 'local'}: {exc}", file=sys.stderr)
        record_job_error(str(exc))
        return CANNOT_BEGIN_EXIT
    except ConfigError as exc:
        print(f"{config.command.value}: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT


# -- the commands -----------------------------------------------------------------------------------------


def run_command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """Launch a new worker and follow it to its end (or, with detach=true, only launch it)."""
    client = open_tracking(config.tracking)
    store = open_state(config)
    sweep = current_sweep(config.fail_fast)
    slurm = current_slurm_job() if sweep is not None else None
    with SlurmSignals(slurm) as signals:  # from the start: Slurm may stop the job before it has a worker
        if slurm is not None and (started := recorded_run(_job_folder(), slurm)) is not None:
            return _resume(config, console, client, store, transport_for, sweep, slurm, started, signals)
        return _run(config, console, client, store, transport_for, sweep, slurm, signals)


def _run(
    config: JobConfig,
    console: Console,
    client: MlflowClient,
    store: StateStore,
    transport_for: TransportFactory,
    sweep: Sweep | None,
    slurm: SlurmJob | None,
    signals: SlurmSignals,
) -> int:
    job_tags = {tags.PARENT_RUN_ID: sweep.parent_run_id, tags.SWEEP_JOB: str(sweep.job_num)} if sweep else {}
    if slurm is not None:
        job_tags[tags.SLURM_JOB_ID] = slurm.job_id
    with outages_named():
        created = create_job_run(
            client, config, _task_overrides(), git_info(), job_tags, _swept_values(sweep) if sweep else None
        )
    experiment_id, run_id = created.experiment_id, created.run_id
    store.note_launched(  # what `last` means: this user's own record, never the tracking store's newest run
        Launched(run_id, config.host.name, config.host.workdir, created.name, time.time(), os.getsid(0),
                 sweep.job_num if sweep is not None else None)
    )  # fmt: skip
    if slurm is not None:  # before the worker exists: a requeue from here on resumes this run
        record_run(_job_folder(), slurm, StartedRun(run_id, experiment_id))
        if (refused := mark_job(slurm, run_id)) is not None:
            console.print(f"[yellow]{slurm.describe()}: its comment could not name the run ({escape(refused)}); "
                          "`cancel=` of this run will refuse to scancel it[/yellow]")  # fmt: skip
    if sweep is not None and (reason := sweep.cancelled()) is not None:
        end_unstarted_job(client, run_id, reason)
        console.print(f"[yellow]job #{sweep.job_num} not started: {reason}[/yellow]")
        return RunStatus.KILLED.exit_code
    if sweep is not None:
        varying = " ".join(f"{k}={v}" for k, v in _swept_values(sweep).items()) or "the grid's defaults"
        of = f" ({sweep.job_num + 1} of {sweep.jobs})" if sweep.jobs else ""
        console.print(f"[bold]sweep job #{sweep.job_num}{of}[/bold]: {varying}")
    state = StreamState(run_id=run_id, host=config.host.name, run_dir=run_dir_for(config.host.workdir, run_id))
    store.lock(run_id)
    transport = transport_for(config)
    return _follow(
        config, console, client, store, transport, experiment_id, state, _launch_body, sweep, signals=signals
    )


def _resume(
    config: JobConfig,
    console: Console,
    client: MlflowClient,
    store: StateStore,
    transport_for: TransportFactory,
    sweep: Sweep,
    slurm: SlurmJob,
    started: StartedRun,
    signals: SlurmSignals,
) -> int:
    """A sweep job Slurm started again (requeued, preempted): carry on with the run it started, never a second."""
    with outages_named():
        run = client.get_run(started.run_id)
    what = f"sweep job #{sweep.job_num}: {slurm.describe()} started again (restart {slurm.restarts})"
    if run.info.status != "RUNNING":
        console.print(f"{what}; its run {started.run_id} has already ended ({run.info.status})")
        return RunStatus(run.info.status).exit_code if run.info.status in RunStatus.__members__ else 1
    console.print(f"[bold]{what}[/bold]: resuming its run {started.run_id}")
    state = store.load(started.run_id) or _state_from_tags(config, started.run_id, run.data.tags)
    if store.lock(started.run_id) is None:
        holder = store.holder(started.run_id)
        raise ConfigError(f"run {started.run_id} is followed by another orchestrator here (pid {holder})")
    started_s_ago = max(0.0, time.time() - run.info.start_time / 1000)
    transport = transport_for(config)
    experiment_id = started.experiment_id
    return _follow(
        config, console, client, store, transport, experiment_id, state, _resume_body, sweep, started_s_ago,
        signals=signals,
    )  # fmt: skip


def attach_command_(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """Follow a run started earlier, from where its event log was last read, to its end."""
    client = open_tracking(config.tracking)
    store = open_state(config)
    found = attached_state(client, store, config, console)
    state = found.state
    if store.lock(state.run_id) is None:
        raise ConfigError(
            f"run {state.run_id} is followed by another orchestrator here (pid {store.holder(state.run_id)}); "
            "stop that one first"
        )
    transport = transport_for(config)
    if (code := _reach(config, transport)) is not None or (code := _proven(config, transport, found)) is not None:
        store.release(state.run_id)
        return code
    experiment_id, started_s_ago = found.experiment_id, found.started_s_ago
    return _follow(
        config, console, client, store, transport, experiment_id, state, _attach_body, None, started_s_ago, found.model
    )


def cancel_command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """Stop a run's worker (SIGTERM, then SIGKILL), apply what it wrote last, end the run KILLED; say what
    happened, once it has happened."""
    client = open_tracking(config.tracking)
    store = open_state(config)
    try:
        found = attached_state(client, store, config, console)
    except RunEnded as ended:  # nothing to stop: say so, as done (the run is not running, as asked)
        console.print(f"{ended}; nothing was cancelled", markup=False, highlight=False)
        return 0
    state = found.state
    transport = transport_for(config)
    if (code := _reach(config, transport)) is not None or (code := _proven(config, transport, found)) is not None:
        return code
    if found.slurm_job is not None:  # its follower is a Slurm job, maybe on another node: Slurm stops it
        return _cancel_slurm_job(config, console, client, transport, state, found.slurm_job)
    if store.lock(state.run_id) is None:  # someone follows it: stop the worker, the follower ends the run
        return _stop_followed(config, console, transport, state, store.holder(state.run_id))
    # (the lock is let go by _follow, when this command is done with the run)
    return _follow(
        config, console, client, store, transport, found.experiment_id, state, _cancel_body, None, model=found.model
    )


def _reach(config: JobConfig, transport: Transport) -> int | None:
    """Connect before touching a run that lives on the host: out of reach is one line (as a run's connect
    failure) and the run is left exactly as it was; None when connected."""
    try:
        transport.open()
    except Exception as exc:  # noqa: BLE001 - ConnectFailed, HostKeyRefused, a socket error: all one line
        print(f"{config.host.name}: {exc}", file=sys.stderr)
        transport.close()
        return RunStatus.FAILED.exit_code
    return None


def _proven(config: JobConfig, transport: Transport, found: Attached) -> int | None:
    """Before anything is applied, uploaded or signalled: the host proves that the run's folder (and its live
    worker) are the run's own (`host/proof.py`), or the command stops with one line naming what did not
    match and changes nothing. A run whose folder was never written (its orchestrator stopped before the
    launch) is ended by attach and cancel as one that never started. None when proven."""
    run_id, workdir = found.state.run_id, config.host.workdir
    try:
        status = worker_status(transport, found.state.run_dir)
        if status.state == "missing" and not found.launched:
            return None
        proof = prove_worker(transport, workdir, run_id, status)
    except Exception as exc:  # noqa: BLE001 - as every command's connect failure
        print(f"{config.host.name}: {exc}", file=sys.stderr)
        transport.close()
        return RunStatus.FAILED.exit_code
    if proof.problem is None:
        return None
    transport.close()
    if proof.facts.folder == "missing":
        print(
            f"{config.host.name}: run {run_id[:8]} has no folder at {found.state.run_dir}, where it lives in "
            "host.workdir; nothing was changed",
            file=sys.stderr,
        )
    else:
        print(f"{config.host.name}: run {run_id[:8]} is not proven yours: {proof.problem}; nothing was changed",
              file=sys.stderr)  # fmt: skip
    return RunStatus.FAILED.exit_code


def _stop_followed(config: JobConfig, console: Console, transport: Transport, state: StreamState, pid: str) -> int:
    """Another orchestrator follows the run: mark it cancelled and stop its worker; the follower reads the
    mark and ends the run KILLED as cancelled by the user (not as a worker that died)."""
    try:
        transport.open()
        before = _mark_cancelled(transport, state.run_dir)
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


def _mark_cancelled(transport: Transport, run_dir: str) -> WorkerStatus:
    """Leave the cancel mark in the run folder if the worker is still there to stop (a worker that had ended
    or died on its own keeps that end); return the worker's status as found."""
    status = worker_status(transport, run_dir)
    if status.alive:
        request_cancel(transport, run_dir)
    return status


def list_command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """The runs whose worker is alive on the host; with list=all, every run of the host in MLflow too."""
    try:
        client: MlflowClient | None = open_tracking(config.tracking)
    except TrackingUnavailable as exc:
        if config.list_all:
            raise
        console.print(f"[yellow]{exc}: listing from the host alone[/yellow]")
        client = None
    transport = transport_for(config)
    try:
        transport.open()
        return list_runs(console, transport, config, client)
    except (TrackingUnavailable, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - every connect failure is the same one line a run gives
        print(f"{config.host.name}: {exc}", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    finally:
        transport.close()


def logs_command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """The worker's stderr and log lines (follow=true: until the worker ends; Ctrl-C stops reading only).

    The run's folder is `host.workdir/runs/<run id>` of the configured work folder (its tags are checked
    against the config, `tracking/location.py`); without MLflow, a full run id is looked for there. Nothing is
    printed from a folder the host does not prove the run's own (`host/proof.py`)."""
    run_id = str(config.run_id)
    try:
        client = open_tracking(config.tracking)
    except TrackingUnavailable as exc:
        if len(run_id) != 32:
            raise
        console.print(f"[yellow]{exc}: looking for the run in {config.host.workdir}[/yellow]")
    else:
        run_id = find_run(client, config, open_state(config), console)
        for note in located(config, run_id, _the_run(client, run_id).data.tags).notes:
            console.print(f"[yellow]{escape(note)}[/yellow]")
    transport = transport_for(config)
    try:
        transport.open()
        proof = prove_folder(transport, config.host.workdir, run_id)
        if proof.problem is not None and proof.facts.folder != "missing":
            print(f"{config.host.name}: run {run_id[:8]} is not proven yours: {proof.problem}; nothing was read",
                  file=sys.stderr)  # fmt: skip
            return RunStatus.FAILED.exit_code
        with CtrlC(console) as ctrl_c:
            return print_logs(
                console, transport, run_dir_for(config.host.workdir, run_id), config.follow,
                config.orchestrator.poll_interval_s, ctrl_c.check, name=f"{config.host.name}: run {run_id[:8]}",
            )  # fmt: skip
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - every connect failure is the same one line a run gives
        print(f"{config.host.name}: {exc}", file=sys.stderr)
        return RunStatus.FAILED.exit_code
    finally:
        transport.close()


COMMANDS = {
    Command.RUN: run_command,
    Command.DETACH: run_command,
    Command.ATTACH: attach_command_,
    Command.CANCEL: cancel_command,
    Command.LOGS: logs_command,
    Command.LIST: list_command,
}

# -- bodies: what each command does between opening and finishing --------------------------------------------


def _launch_body(job: Job) -> Outcome:
    open_host(job)
    report = preflight(job)
    job.check_interrupt()  # a Ctrl-C that a host command swallowed (Invoke forwards it and carries on)
    code_dir = sync(job)
    job.check_interrupt()
    launch(job, report, code_dir)
    if job.config.command is Command.DETACH:
        return Outcome(RunStatus.DETACHED)
    return conclude(job, follow(job))


def _attach_body(job: Job) -> Outcome:
    open_host(job, leave_if_unreachable=True)
    job.launched = True
    check_resume_point(job)
    return conclude(job, follow(job))


def _resume_body(job: Job) -> Outcome:
    """The run of a requeued Slurm job: follow its worker if it still runs or ended on its own; else (Slurm
    stopped it with the job) start it again in the same run, its event log continued."""
    open_host(job)
    job.launched = True
    if not worker_status(job.transport, job.state.run_dir).alive and not ended_on_its_own(job):
        report = preflight(job)
        code_dir = sync(job)
        job.check_interrupt()
        relaunch(job, report, code_dir)
    return conclude(job, follow(job))


def _cancel_body(job: Job) -> Outcome:
    """Stop the worker if it still runs (the lifecycle's stop, on `Interrupted`); a worker that had already
    ended keeps its end, which this command records and names as such."""
    open_host(job, leave_if_unreachable=True)
    job.launched = True
    check_resume_point(job)
    try:
        before = _mark_cancelled(job.transport, job.state.run_dir)
    except CONNECTION_ERRORS:  # the mark is for a later attach; this command stops and ends the run
        before = WorkerStatus("running")
    if before.alive:
        raise Interrupted(CANCELLED_BY_USER)
    job.found_ended = True
    return conclude(job, follow(job))


# -- shared by the commands ---------------------------------------------------------------------------------


def open_state(config: JobConfig) -> StateStore:
    store = StateStore(Path(config.orchestrator.state_dir))
    store.check()
    return store


@dataclass(frozen=True)
class Attached:
    """A run started earlier, as `attach` and `cancel` pick it up."""

    experiment_id: str
    state: StreamState
    started_s_ago: float  # for the start deadline
    model: str  # the run's own (its `model` tag, escaped): the command line's `model=` is only its default
    launched: bool = False  # its tags say its launch wrote its folder (a hint: the host's proof decides)
    slurm_job: str | None = None  # the Slurm job that follows it (a sweep job of submitit_slurm), as tagged


class RunEnded(ConfigError):
    """The run the command names has already ended in MLflow."""


def _the_run(client: MlflowClient, run_id: str) -> Run:
    """The MLflow run a command names; one that is not in this tracking store is a one-line ConfigError."""
    try:
        with outages_named():
            return client.get_run(run_id)
    except MlflowException as exc:
        raise ConfigError(f"no MLflow run {run_id} at this tracking URI") from exc


def attached_state(client: MlflowClient, store: StateStore, config: JobConfig, console: Console) -> Attached:
    """Where the last orchestrator of this run stopped: its state file, else the run's own tags, each checked
    against the config (`tracking/location.py`): what differs is said in one line before anything is done."""
    run_id = find_run(client, config, store, console)
    run = _the_run(client, run_id)
    if run.info.status != "RUNNING":
        raise RunEnded(f"run {run_id} has already ended ({run.info.status})")
    where = located(config, run_id, run.data.tags)
    for note in where.notes:
        console.print(f"[yellow]{escape(note)}[/yellow]")
    state = store.load(run_id)
    if state is not None and state.run_dir != where.run_dir:
        raise ConfigError(
            f"run {run_id[:8]} was launched from here into {posixpath.dirname(posixpath.dirname(state.run_dir))}; "
            f"this command's host.workdir is {config.host.workdir}: give host.workdir= that folder"
        )
    if state is None:
        state = _state_from_tags(config, run_id, run.data.tags, console)
    started_s_ago = max(0.0, time.time() - run.info.start_time / 1000)
    model = printable(run.data.tags.get(tags.MODEL) or "?")[:80]
    launched = tags.HOST_RUN_DIR in run.data.tags
    return Attached(run.info.experiment_id, state, started_s_ago, model, launched, run.data.tags.get(tags.SLURM_JOB_ID))


def _state_from_tags(config: JobConfig, run_id: str, run_tags: dict[str, str], console: Console) -> StreamState:
    """Where the stream stands, from the run's own tags (another machine's orchestrator followed it). A cursor
    that is not a valid one is said, and the log is applied from its start (MLflow keeps one row per metric,
    step, time and value, so what was applied before lands once): nothing is skipped on a tag's word."""
    state = StreamState(run_id=run_id, host=config.host.name, run_dir=run_dir_for(config.host.workdir, run_id))
    cursor = {}
    for tag, default, least, what in (
        (tags.LAST_SEQ, "-1", -1, "an event's seq"),
        (tags.OFFSET, "0", 0, "a byte offset"),
    ):
        raw = run_tags.get(tag, default)
        try:
            cursor[tag] = host_values.integer(raw, least)
        except ValueError:
            console.print(f"[yellow]run {run_id[:8]}: its stream cursor tag {tag}={escape(shown(raw))} is not {what}: "
                          "the event log is applied from its start[/yellow]")  # fmt: skip
            return state
    state.last_seq, state.offset = cursor[tags.LAST_SEQ], cursor[tags.OFFSET]
    return state


def _follow(
    config: JobConfig,
    console: Console,
    client: MlflowClient,
    store: StateStore,
    transport: Transport,
    experiment_id: str,
    state: StreamState,
    body: Callable[[Job], Outcome],
    sweep: Sweep | None,
    started_s_ago: float = 0.0,
    model: str | None = None,
    signals: SlurmSignals | None = None,
) -> int:
    """`model`: the run's own, for a run started earlier (else the config's, which is the run's). `signals`:
    Slurm's, for a sweep job Slurm runs."""
    signals = signals or SlurmSignals(None)
    verb = {Command.ATTACH: "attached to", Command.CANCEL: "cancelling"}.get(config.command, "run")
    model = escape(model or config.model_name)
    console.print(f"[bold]{verb}[/bold] {state.run_id} on [bold]{config.host.name}[/bold] · {model}")
    try:
        with LiveProgress(console) as live, CtrlC(console) as ctrl_c:
            job = Job(
                config=config,
                console=console,
                live=live,
                client=client,
                store=store,
                transport=transport,
                experiment_id=experiment_id,
                state=state,
                check_interrupt=_interrupt_check(ctrl_c, sweep, signals),
                stopping=_stopping(ctrl_c, signals),
                stop_grace_s=STOP_GRACE_S if signals.job is not None else None,
                sweep=sweep,
                started_s_ago=started_s_ago,
            )
            outcome = lifecycle(job, body)
    finally:
        transport.close()
        store.release(state.run_id)
    if sweep is not None:
        if ctrl_c.requested:
            sweep.cancel("the sweep was interrupted (Ctrl-C)")
        elif sweep.fail_fast and outcome.status is RunStatus.FAILED:
            sweep.cancel(f"job #{sweep.job_num} failed and sweep.fail_fast is set: {outcome.error}")
    if outcome.status is RunStatus.DETACHED and outcome.stage is Stage.SLURM:
        console.print(f"[yellow]{outcome.error}[/yellow]")
        # Requeued: end this run of the Slurm job without a result, as submitit's own requeue does, so that the
        # launcher waits for the job Slurm starts again (which resumes the run) instead of taking this as its end.
        raise SystemExit(outcome.status.exit_code)
    return _report(console, job, outcome)


def _report(console: Console, job: Job, outcome: Outcome) -> int:
    config, run_id = job.config, job.state.run_id
    if outcome.status is RunStatus.DETACHED and outcome.stage is Stage.FOLLOW:  # refused: the run untouched
        print(outcome.error, file=sys.stderr)
        return RunStatus.FAILED.exit_code
    if outcome.status is RunStatus.DETACHED:
        command = attach_command(config, run_id)
        if config.command is Command.DETACH and not outcome.error:
            console.print("launched and detached; follow it with:")
            console.print(f"  {command}", soft_wrap=True, markup=False, highlight=False)
            console.print(run_url(job.client, job.experiment_id, run_id), soft_wrap=True, markup=False, highlight=False)
            return 0
        console.print(f"[yellow]{outcome.error}[/yellow]")
        console.print("The run stays RUNNING in MLflow. Finish following it with:")
        console.print(f"  {command}", soft_wrap=True, markup=False, highlight=False)
        return outcome.status.exit_code
    if config.command is Command.CANCEL:  # done as asked: the run has ended, and the line says how
        console.print(cancel_outcome(run_id, outcome, job.found_ended), markup=False, highlight=False)
        return 0
    if outcome.status is RunStatus.FAILED and outcome.stage is Stage.WORKER and job.stderr_tail:
        console.print("[red]last lines of the worker's stderr:[/red]")
        for line in job.stderr_tail:
            console.print(f"  {line}", markup=False, highlight=False)
    links = {"mlflow run": run_id}
    if not job.client.tracking_uri.startswith("http"):
        links["ui"] = "`make ui` serves the local store at the address below"
    console.print(summary_table(outcome.status.value, outcome.error, job.summary, links))
    # On a line of its own and never folded, so that it can be clicked or pasted whatever the width.
    console.print(run_url(job.client, job.experiment_id, run_id), soft_wrap=True, markup=False, highlight=False)
    return outcome.code


def cancel_outcome(run_id: str, outcome: Outcome, found_ended: bool) -> str:
    """What a cancel did, said after it was done: the worker stopped by it, one that had already ended, or one
    that ended on its own while the cancel was on its way."""
    status = outcome.status.value
    why = f" ({outcome.error})" if outcome.error and outcome.status is not RunStatus.KILLED else ""
    if found_ended:
        return f"{run_id} had already ended before the cancel: the run ends {status}{why}; nothing was stopped"
    if outcome.status is RunStatus.KILLED:
        return f"cancelled {run_id}: its worker was stopped and the run ends KILLED"
    return f"{run_id} finished before the cancel reached it: the run ends {status}{why}"


def _stopping(ctrl_c: CtrlC, slurm: SlurmSignals) -> Callable[[], None]:
    """What the lifecycle calls once it begins to stop the worker: neither Ctrl-C nor Slurm breaks that off."""

    def stopping() -> None:
        ctrl_c.stopping()
        slurm.disarm()

    return stopping


def _interrupt_check(ctrl_c: CtrlC, sweep: Sweep | None, slurm: SlurmSignals) -> Callable[[], None]:
    """What the follow loop calls between polls: Ctrl-C, Slurm's signals, and a sweep cancelled by another job."""

    def check() -> None:
        ctrl_c.check()
        slurm.check()
        slurm.arm()  # inside the lifecycle now: a later stop by Slurm raises where it lands
        if sweep is not None:
            sweep.check()

    return check


def _job_folder() -> Path:
    """This job's own output folder (`<sweep dir>/<job number>/` in a multirun)."""
    return Path(str(HydraConfig.get().runtime.output_dir))


def _task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task)


def _swept_values(sweep: Sweep) -> dict[str, str]:
    """This sweep job's values of the keys the sweep varies (its grid and the command line's), for its name."""
    hydra_cfg = HydraConfig.get()
    swept = set(sweep.swept) or set((hydra_cfg.sweeper.get("params") or {}).keys())
    values = {}
    for override in hydra_cfg.overrides.task:
        key, _, value = str(override).lstrip("+~").partition("=")
        if key in swept:
            values[key] = value
    return values


def _keep_hydra_files_secret() -> None:
    """Hydra has written the job's config and overrides into its output folder: redact them there."""
    hydra_cfg = HydraConfig.get()
    redact_hydra_outputs(Path(str(hydra_cfg.runtime.output_dir)))
    if hydra_cfg.mode == RunMode.MULTIRUN:
        folder = Path(str(hydra_cfg.sweep.dir))
        redact_hydra_outputs(folder if folder.is_absolute() else Path(str(hydra_cfg.runtime.cwd)) / folder)


__all__ = ["HostLost", "PhaseFailed", "run_job"]
