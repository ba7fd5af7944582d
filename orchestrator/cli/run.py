"""`python -m orchestrator [overrides]` and `detach=true`: create the run, launch its worker, follow it (a
Slurm job that was requeued resumes the run it started).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.markup import escape

from orchestrator.cli import context
from orchestrator.cli.context import TransportFactory
from orchestrator.cli.following import follow_run
from orchestrator.cli.picked_up import state_from_tags
from orchestrator.config.host_values import run_dir_for
from orchestrator.config.prompts import prompts_file_text
from orchestrator.config.settings import Command, JobConfig
from orchestrator.config.text import printable
from orchestrator.config.validation import ConfigError
from orchestrator.host.run_folder import worker_status
from orchestrator.lifecycle.job import Job
from orchestrator.lifecycle.phases import (
    conclude,
    ended_on_its_own,
    follow,
    launch,
    open_host,
    preflight,
    relaunch,
    sync,
)
from orchestrator.stream.state import Launched, StateStore, StreamState
from orchestrator.sweep import Sweep
from orchestrator.sweep.membership import read_sweep_record
from orchestrator.sweep.plan import progress_line
from orchestrator.sweep.resume import HandedPhase1, find_finished, find_phase_1, reused_tag
from orchestrator.sweep.slurm import (
    SlurmJob,
    SlurmSignals,
    StartedRun,
    current_slurm_job,
    mark_job,
    record_run,
    recorded_run,
)
from orchestrator.tracking import tags
from orchestrator.tracking.client import outages_named
from orchestrator.tracking.runs import create_job_run, end_unstarted_job, ensure_experiment
from orchestrator.tracking.settings_digest import settings_params
from orchestrator.tracking.signing import KeyUnavailable, signing_key
from orchestrator.tracking.status import Outcome, RunStatus


def command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """Launch a new worker and follow it to its end (or, with detach=true, only launch it)."""
    client = context.open_tracking(config.tracking)
    store = context.open_state(config)
    sweep = context.current_sweep(config.fail_fast)
    slurm = current_slurm_job() if sweep is not None else None
    with SlurmSignals(slurm) as signals:  # from the start: Slurm may stop the job before it has a worker
        if slurm is not None and (started := recorded_run(context.job_folder(), slurm)) is not None:
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
    settings = job_settings(config)
    handed = None
    if sweep is not None and config.resume:
        if _finished_before(config, console, client, sweep, settings):
            return RunStatus.FINISHED.exit_code
        handed = _phase_1_before(config, console, client, sweep, settings)
    with outages_named():
        created = create_job_run(
            client,
            config,
            context.task_overrides(),
            context.git_info(),
            job_tags,
            context.swept_values(sweep) if sweep else None,
            settings,
        )
    experiment_id, run_id = created.experiment_id, created.run_id
    if handed is not None:
        with outages_named():
            client.set_tag(run_id, tags.PHASE_1_FROM, handed.run_id)
    store.note_launched(  # what `last` means: this user's own record, never the tracking store's newest run
        Launched(run_id, config.host.name, config.host.workdir, created.name, time.time(), os.getsid(0),
                 sweep.job_num if sweep is not None else None)
    )  # fmt: skip
    if slurm is not None:  # before the worker exists: a requeue from here on resumes this run
        record_run(context.job_folder(), slurm, StartedRun(run_id, experiment_id))
        if (refused := mark_job(slurm, run_id)) is not None:
            console.print(f"[yellow]{slurm.describe()}: its comment could not name the run ({escape(refused)}); "
                          "`cancel=` of this run will refuse to scancel it[/yellow]")  # fmt: skip
    if sweep is not None and (reason := sweep.cancelled()) is not None:
        end_unstarted_job(client, run_id, reason)
        console.print(f"[yellow]job #{sweep.job_num} not started: {reason}[/yellow]")
        return RunStatus.KILLED.exit_code
    if sweep is not None:
        varying = " ".join(f"{k}={v}" for k, v in context.swept_values(sweep).items()) or "the grid's defaults"
        of = f" ({sweep.job_num + 1} of {sweep.jobs})" if sweep.jobs else ""
        console.print(f"[bold]sweep job #{sweep.job_num}{of}[/bold]: {varying}")
    state = StreamState(run_id=run_id, host=config.host.name, run_dir=run_dir_for(config.host.workdir, run_id))
    store.lock(run_id)
    transport = transport_for(config)
    code = follow_run(
        config, console, client, store, transport, experiment_id, state, launch_body, sweep, signals=signals,
        handed_phase_1=handed.data if handed is not None else None,
    )  # fmt: skip
    if sweep is not None:
        _say_progress(console, client, sweep)
    return code


def _say_progress(console: Console, client: MlflowClient, sweep: Sweep) -> None:
    """The sweep's GPU-time so far and left, as this job ends (`sweep/plan.py`); a nicety, never an error."""
    record = read_sweep_record(sweep.dir) or {}
    if not record.get("records"):
        return
    try:
        with outages_named():
            line = progress_line(client, sweep.parent_run_id, record["records"], sweep.reused_here())
    except Exception:  # noqa: BLE001 - the estimate is an extra; the job's own outcome is already said
        return
    console.print(line, markup=False, highlight=False)


def job_settings(config: JobConfig) -> dict[str, str]:
    """What decides the job's figures (`tracking/settings_digest.py`), the prompt set's text included."""
    experiment = config.worker_sections["experiment"]
    text = prompts_file_text(experiment.get("prompts"), experiment.get("datasets_dir"))
    return settings_params(config.resolved, text)


def _finished_before(
    config: JobConfig, console: Console, client: MlflowClient, sweep: Sweep, settings: dict[str, str]
) -> bool:
    """`sweep.resume`: when a checked run of the experiment already FINISHED with these settings, the sweep's
    parent names it for this job (its page takes that run's figures) and nothing is decoded (True)."""
    with outages_named():
        experiment_id = ensure_experiment(client, config.experiment_name, config.tracking.artifact_root)
        try:
            key = signing_key(Path(config.orchestrator.state_dir))
        except KeyUnavailable as exc:
            console.print(f"[yellow]sweep.resume: {escape(str(exc))}: decoding again[/yellow]")
            return False
        lookup = find_finished(client, experiment_id, settings, key)
    varying = " ".join(f"{k}={v}" for k, v in context.swept_values(sweep).items()) or "the grid's defaults"
    of = f" ({sweep.job_num + 1} of {sweep.jobs})" if sweep.jobs else ""
    found = lookup.found
    if found is None:
        if lookup.refused is not None:
            console.print(
                f"sweep job #{sweep.job_num}{of}: a FINISHED run with these settings is not reused "
                f"({escape(printable(lookup.refused))}): decoding again"
            )
        return False
    with outages_named():
        client.set_tag(sweep.parent_run_id, reused_tag(sweep.job_num), found.run_id)
    sweep.note_reused(found.run_id)
    console.print(
        f"[bold]sweep job #{sweep.job_num}{of}[/bold]: {escape(varying)} · already FINISHED with these settings "
        f"as run {found.run_id} ({escape(printable(found.name))}): not decoded again"
    )
    _say_progress(console, client, sweep)
    return True


def _phase_1_before(
    config: JobConfig, console: Console, client: MlflowClient, sweep: Sweep, settings: dict[str, str]
) -> HandedPhase1 | None:
    """`sweep.resume` of a two-phase job that no FINISHED run stands for: the phase 1 of a run with these settings
    that stopped in phase 2, checked (`sweep/resume.py`), for the new run to go on from."""
    if config.worker_sections["decode"].get("protocol") != "two_phase":
        return None
    with outages_named():
        experiment_id = ensure_experiment(client, config.experiment_name, config.tracking.artifact_root)
        try:
            key = signing_key(Path(config.orchestrator.state_dir))
        except KeyUnavailable:
            return None  # said once already, by the FINISHED run's lookup
        lookup = find_phase_1(client, experiment_id, settings, key)
    of = f" ({sweep.job_num + 1} of {sweep.jobs})" if sweep.jobs else ""
    if lookup.found is None:
        if lookup.refused is not None:
            console.print(
                f"sweep job #{sweep.job_num}{of}: phase 1 of a stopped run is not reused "
                f"({escape(printable(lookup.refused))}): decoding both phases"
            )
        return None
    found = lookup.found
    console.print(
        f"sweep job #{sweep.job_num}{of}: phase 1 taken from run {found.run_id} ({found.status}, stopped in phase "
        "2, signed by this user): decoding phase 2 only"
    )
    return found


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
    state = store.load(started.run_id) or state_from_tags(config, started.run_id, run.data.tags)
    if store.lock(started.run_id) is None:
        holder = store.holder(started.run_id)
        raise ConfigError(f"run {started.run_id} is followed by another orchestrator here (pid {holder})")
    started_s_ago = max(0.0, time.time() - run.info.start_time / 1000)
    transport = transport_for(config)
    experiment_id = started.experiment_id
    return follow_run(
        config, console, client, store, transport, experiment_id, state, resume_body, sweep, started_s_ago,
        signals=signals,
    )  # fmt: skip


def launch_body(job: Job) -> Outcome:
    open_host(job)
    report = preflight(job)
    job.check_interrupt()  # a Ctrl-C that a host command swallowed (Invoke forwards it and carries on)
    code_dir = sync(job)
    job.check_interrupt()
    launch(job, report, code_dir)
    if job.config.command is Command.DETACH:
        return Outcome(RunStatus.DETACHED)
    return conclude(job, follow(job))


def resume_body(job: Job) -> Outcome:
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
