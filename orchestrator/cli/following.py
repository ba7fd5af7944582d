"""Following a run to its end, the same for every command: the live view, Ctrl-C and Slurm's signals, the
lifecycle, and the report (the summary table, the attach line, or what a cancel did).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.markup import escape

from orchestrator.config.commands import attach_command
from orchestrator.config.settings import Command, JobConfig
from orchestrator.host.transport import Transport
from orchestrator.lifecycle.display import LiveProgress, summary_table
from orchestrator.lifecycle.interrupt import CtrlC
from orchestrator.lifecycle.job import Job
from orchestrator.lifecycle.outcomes import lifecycle
from orchestrator.stream.state import StateStore, StreamState
from orchestrator.sweep import Sweep
from orchestrator.sweep.slurm import (
    STOP_GRACE_S,
    SlurmSignals,
)
from orchestrator.tracking.runs import run_url
from orchestrator.tracking.status import Outcome, RunStatus, Stage


def follow_run(
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
    handed_phase_1: bytes | None = None,
) -> int:
    """`model`: the run's own, for a run started earlier (else the config's, which is the run's). `signals`:
    Slurm's, for a sweep job Slurm runs. `handed_phase_1`: an earlier run's phase 1 for the worker to go on
    from (`sweep/resume.py`)."""
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
                handed_phase_1=handed_phase_1,
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
