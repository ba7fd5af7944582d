"""One job, start to end: validate, create the MLflow run, launch the worker, follow it, finish the run."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from rich.console import Console

from orchestrator import PROJECT_ROOT
from orchestrator.commands import cancel_run, list_runs
from orchestrator.display import LiveProgress, summary_table
from orchestrator.gitinfo import git_info
from orchestrator.interrupt import CtrlC
from orchestrator.launch import (
    STDERR_FILE,
    run_dir_for,
    start_worker,
    stop_worker,
    wait_for_start,
    write_spec,
)
from orchestrator.plots import SUMMARY_FILE, plot_decode_summary
from orchestrator.preflight import PreflightFailed, lease_candidates, run_preflight
from orchestrator.prompts import prompts_file_text
from orchestrator.redaction import redact_url
from orchestrator.ssh_transport import CONNECTION_ERRORS, ConnectFailed, HostKeyRefused, SSHTransport
from orchestrator.state import StateStore, StreamState
from orchestrator.stream import HostUnreachable, drain, follow, wait_for_exit
from orchestrator.sweep import (
    JOB_TAG,
    Sweep,
    SweepCancelled,
    assign_host,
    current_sweep,
    end_unstarted_job,
    record_job_error,
)
from orchestrator.sync import sync_code
from orchestrator.tracking.runs import DETACHED, EXIT_CODES, connect, create_job_run, finish, run_url
from orchestrator.tracking.sink import DETACHED_TAG, LAST_SEQ_TAG, OFFSET_TAG, MlflowSink
from orchestrator.transport import LocalTransport, Transport
from orchestrator.validation import ConfigError, resolve_config
from remote_worker.prompt_set import RUN_PROMPTS_FILE

EVENTS_ARTIFACT = "events.jsonl"
STDERR_TAIL_LINES = 20


@dataclass
class Outcome:
    status: str
    error: str | None = None
    stage: str | None = None


def worker_spec(config: dict[str, Any], run_id: str, run_dir: str, prompts_sent: bool = False) -> dict[str, Any]:
    """The spec file: only what the worker needs (never host, tracking or orchestrator settings).

    prompts_sent: the run folder holds the prompt set the orchestrator chose (`experiment.prompts_file`)."""
    experiment = dict(config["experiment"], **({"prompts_file": RUN_PROMPTS_FILE} if prompts_sent else {}))
    return {
        "run_id": run_id,
        "run_dir": run_dir,
        "seed": config["seed"],
        "experiment": experiment,
        "model": config["model"],
        "decode": config["decode"],
        "probe": config["probe"],
    }


def make_transport(host: dict[str, Any]) -> Transport:
    if host["kind"] == "ssh":
        return SSHTransport(host)
    return LocalTransport(host["name"])


def run_job(cfg: DictConfig) -> int:
    """Run (or attach to) one job; return its exit code (see EXIT_CODES; 2 for a bad config)."""
    console = Console()
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # the summary prints the URL
    logging.getLogger("paramiko").setLevel(logging.WARNING)  # connection chatter; reconnects are reported
    try:
        config = resolve_config(assign_host(cfg))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        record_job_error(f"config error: {exc}")
        return 2
    host = config["host"]
    if config["list"]:
        transport = make_transport(host)
        transport.open()
        try:
            return list_runs(console, transport, host)
        finally:
            transport.close()
    client = connect(config["tracking"])
    store = StateStore(Path(config["orchestrator"]["state_dir"]))
    existing = config["attach"] or config["cancel"]
    sweep: Sweep | None = None
    if existing:
        try:
            experiment_id, state = _attached_state(client, store, host, existing)
        except ConfigError as exc:
            print(f"{'attach' if config['attach'] else 'cancel'}: {exc}", file=sys.stderr)
            return 2
        if config["cancel"]:
            transport = make_transport(host)
            transport.open()
            try:
                grace = float(config["orchestrator"]["kill_grace_s"])
                return cancel_run(console, client, transport, experiment_id, state, store, grace)
            finally:
                transport.close()
    else:
        sweep = current_sweep(config["sweep"]["fail_fast"])
        job_tags = {"mlflow.parentRunId": sweep.parent_run_id, JOB_TAG: str(sweep.job_num)} if sweep else {}
        overrides = HydraConfig.get().overrides.task
        experiment_id, run_id = create_job_run(client, config, overrides, git_info(), job_tags)
        if sweep is not None and (reason := sweep.cancelled()) is not None:
            end_unstarted_job(client, run_id, reason)
            console.print(f"[yellow]job #{sweep.job_num} not started: {reason}[/yellow]")
            return EXIT_CODES["KILLED"]
        state = StreamState(run_id=run_id, host=host["name"], run_dir=run_dir_for(host["workdir"], run_id))
    run_id, run_dir = state.run_id, state.run_dir
    transport = make_transport(host)
    sink = MlflowSink(client, experiment_id, state, store, transport)
    verb = "attached to" if config["attach"] else "run"
    console.print(f"[bold]{verb}[/bold] {run_id} on [bold]{host['name']}[/bold] · {config['model']['name']}")
    with LiveProgress(console) as live, CtrlC(console) as ctrl_c:
        outcome = _launch_and_follow(config, transport, sink, live, ctrl_c, sweep)
    if sweep is not None:
        _end_sweep_early_if_needed(sweep, outcome, ctrl_c)
    if outcome.status == DETACHED:
        transport.close()
        if config["detach"] and outcome.error is None:  # asked for: launched, not lost
            command = _mark_detached(client, config, run_id)
            console.print(f"launched and detached; follow it with:\n  {command}")
            return 0
        return _leave_detached(console, client, config, run_id, outcome)
    stderr_tail: list[str] = []
    if outcome.stage != "connect":  # past a failed connect there is nothing to fetch
        try:
            if outcome.stage in ("stream", "worker"):  # a fresh connection: the streaming one may have been cut
                transport.reconnect()
            stderr_tail = _log_run_files(client, transport, run_id, run_dir)
            if outcome.status == "FINISHED":
                _log_plots(client, transport, run_id, run_dir)
        except CONNECTION_ERRORS as exc:
            console.print(f"[yellow]could not fetch the run's files from {host['name']}: {exc}[/yellow]")
    if outcome.error and sink.error is None:  # a worker traceback has already set both tags
        client.set_tag(run_id, "failure_stage", outcome.stage or "worker")
        client.set_tag(run_id, "error", outcome.error)
    if config["attach"]:
        client.set_tag(run_id, DETACHED_TAG, "false")  # followed to its end after all
    finish(client, sink.run_ids(), outcome.status)
    transport.close()
    summary = (sink.end or {}).get("summary") or {}
    _print_summary(console, client, experiment_id, run_id, outcome, summary, stderr_tail)
    return EXIT_CODES[outcome.status]


def _attached_state(
    client: MlflowClient, store: StateStore, host: dict[str, Any], run_id: str
) -> tuple[str, StreamState]:
    """Where the last orchestrator of this run stopped: its state file, else the run's own tags."""
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise ConfigError(f"no MLflow run {run_id} at this tracking URI") from exc
    if run.info.status != "RUNNING":
        raise ConfigError(f"run {run_id} has already ended ({run.info.status})")
    if run.data.tags.get("host") != host["name"]:
        raise ConfigError(
            f"run {run_id} ran on host {run.data.tags.get('host')!r}; pass host={run.data.tags.get('host')}"
        )
    state = store.load(run_id)
    if state is None:
        tags = run.data.tags
        state = StreamState(
            run_id=run_id,
            host=host["name"],
            run_dir=run_dir_for(host["workdir"], run_id),
            last_seq=int(tags.get(LAST_SEQ_TAG, -1)),
            offset=int(tags.get(OFFSET_TAG, 0)),
        )
    return run.info.experiment_id, state


def _leave_detached(
    console: Console, client: MlflowClient, config: dict[str, Any], run_id: str, outcome: Outcome
) -> int:
    """The host stayed out of reach: the worker may well still be running, so the run is not ended."""
    command = _mark_detached(client, config, run_id)
    console.print(f"[yellow]{outcome.error}[/yellow]")
    console.print(f"The run stays RUNNING in MLflow; the worker goes on if it can. Follow it again with:\n  {command}")
    return EXIT_CODES[DETACHED]


def _mark_detached(client: MlflowClient, config: dict[str, Any], run_id: str) -> str:
    """Tag the run as followed by nobody, with the command that follows it again; return that command."""
    command = attach_command(config, run_id)
    client.set_tag(run_id, DETACHED_TAG, "true")
    client.set_tag(run_id, "attach_command", command)
    return command


def attach_command(config: dict[str, Any], run_id: str) -> str:
    """The command that resumes following `run_id` (same host and tracking, from the state saved so far)."""
    return shlex.join(
        [
            "python",
            "-m",
            "orchestrator",
            f"attach={run_id}",
            f"host={config['host']['name']}",
            f"tracking={config['tracking']['kind']}",
            f"tracking.uri={redact_url(config['tracking']['uri'])}",
        ]
    )


def _interrupt_check(ctrl_c: CtrlC, sweep: Sweep | None) -> Callable[[], None]:
    """What the follow loop calls between polls: Ctrl-C, and a sweep cancelled by another job."""
    if sweep is None:
        return ctrl_c.check

    def check() -> None:
        ctrl_c.check()
        sweep.check()

    return check


def _end_sweep_early_if_needed(sweep: Sweep, outcome: Outcome, ctrl_c: CtrlC) -> None:
    if ctrl_c.requested:
        sweep.cancel("the sweep was interrupted (Ctrl-C)")
    elif sweep.fail_fast and outcome.status == "FAILED":
        sweep.cancel(f"job #{sweep.job_num} failed and sweep.fail_fast is set: {outcome.error}")


def _launch_and_follow(
    config: dict[str, Any],
    transport: Transport,
    sink: MlflowSink,
    live: LiveProgress,
    ctrl_c: CtrlC,
    sweep: Sweep | None = None,
) -> Outcome:
    host, run_dir = config["host"], sink.state.run_dir
    grace = float(config["orchestrator"]["kill_grace_s"])
    stage = "connect"
    try:
        transport.open()
        if not config["attach"]:
            stage = "preflight"
            report = run_preflight(transport, host, config["model"], host["python"] or sys.executable)
            stage = "sync"
            if isinstance(transport, SSHTransport):
                code_dir, copied = sync_code(transport, host["workdir"], method=host["sync"])
                live.note(f"code snapshot {code_dir} ({'copied' if copied else 'already on the host'})")
            else:
                code_dir = str(PROJECT_ROOT)
            stage = "launch"
            prompts = prompts_file_text(config["experiment"].get("prompts"))
            spec = worker_spec(config, sink.state.run_id, run_dir, prompts_sent=prompts is not None)
            write_spec(transport, run_dir, spec, prompts)
            gpus = lease_candidates(host, report)
            python = host["python"] or sys.executable
            start_worker(transport, run_dir, python, code_dir, host["env"], gpus, host["gpu_lock_dir"])
            wait_for_start(transport, run_dir)
            if config["detach"]:
                return Outcome(DETACHED, None, "launch")
        stage = "stream"
        poll = float(config["orchestrator"]["poll_interval_s"])
        budget = float(host.get("reconnect_budget_s", 0))
        gone = follow(transport, sink, live.show, poll, _interrupt_check(ctrl_c, sweep), budget, live.note)
        if gone is not None:
            return Outcome("FAILED", f"{gone.describe()} before reporting an end event", "worker")
        assert sink.end is not None
        if wait_for_exit(transport, run_dir, grace, budget, live.note).alive:
            stop_worker(transport, run_dir, grace)
        return Outcome(str(sink.end.get("status", "FAILED")), sink.end.get("error"), "worker")
    except HostUnreachable as exc:
        return Outcome(DETACHED, str(exc), stage)
    except (KeyboardInterrupt, SweepCancelled) as exc:
        reason = f"cancelled: {exc}" if isinstance(exc, SweepCancelled) else "interrupted by the user (Ctrl-C)"
        return _stop_on_request(transport, sink, live, ctrl_c, reason, stage, grace)
    except PreflightFailed as exc:
        return Outcome("FAILED", str(exc), stage)
    except (ConnectFailed, HostKeyRefused) as exc:
        return Outcome("FAILED", f"{host['name']}: {exc}", stage)
    except Exception as exc:  # noqa: BLE001 - any failure ends the run FAILED, with the worker stopped
        if ctrl_c.requested:  # a local command the Ctrl-C also reached failed before the flag was seen
            return _stop_on_request(transport, sink, live, ctrl_c, "interrupted by the user (Ctrl-C)", stage, grace)
        if stage in ("launch", "stream"):
            with contextlib.suppress(Exception):
                stop_worker(transport, run_dir, grace)
        return Outcome("FAILED", f"{host['name']}: {type(exc).__name__}: {exc}", stage)


def _stop_on_request(
    transport: Transport, sink: MlflowSink, live: LiveProgress, ctrl_c: CtrlC, reason: str, stage: str, grace: float
) -> Outcome:
    """Ctrl-C or a cancelled sweep: stop the worker, apply its last events, end the run KILLED."""
    ctrl_c.stopping()
    live.note(f"[yellow]{reason}: stopping the worker[/yellow]")
    if stage in ("launch", "stream"):
        stop_worker(transport, sink.state.run_dir, grace)
        drain(transport, sink, live.show)
    return Outcome("KILLED", reason, stage)


def _log_run_files(client: MlflowClient, transport: Transport, run_id: str, run_dir: str) -> list[str]:
    """Log the whole event log and the worker's stderr; return the last lines of stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        tail: list[str] = []
        for name in (EVENTS_ARTIFACT, STDERR_FILE, RUN_PROMPTS_FILE):
            local = Path(tmp) / name
            if transport.fetch(posixpath.join(run_dir, name), local):
                client.log_artifact(run_id, str(local))
                if name == STDERR_FILE:
                    tail = local.read_text(encoding="utf-8", errors="replace").splitlines()[-STDERR_TAIL_LINES:]
        return tail


def _log_plots(client: MlflowClient, transport: Transport, run_id: str, run_dir: str) -> None:
    """Plots of a decode sweep, when the worker wrote its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / SUMMARY_FILE
        if transport.fetch(posixpath.join(run_dir, SUMMARY_FILE), summary):
            for figure in plot_decode_summary(summary, Path(tmp)):
                client.log_artifact(run_id, str(figure), artifact_path="plots")


def _print_summary(
    console: Console,
    client: MlflowClient,
    experiment_id: str,
    run_id: str,
    outcome: Outcome,
    summary: dict[str, Any],
    stderr_tail: list[str],
) -> None:
    if outcome.status == "FAILED" and outcome.stage == "worker" and stderr_tail:
        console.print("[red]last lines of the worker's stderr:[/red]")
        for line in stderr_tail:
            console.print(f"  {line}", markup=False, highlight=False)
    links = {"mlflow run": run_id, "url": run_url(client, experiment_id, run_id)}
    if not client.tracking_uri.startswith("http"):
        links["ui"] = "run `make ui` to serve the local store at that address"
    console.print(summary_table(outcome.status, outcome.error, summary, links))
