"""A run started earlier, as `attach`, `cancel` and `logs` pick it up: named (`run_ref.py`), read from the
tracking store, checked against the config (`tracking/location.py`), proven on its host (`host/proof.py`).
"""

from __future__ import annotations

import posixpath
import shlex
import sys
import time
from dataclasses import dataclass

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.markup import escape

from orchestrator.cli.run_ref import find_run
from orchestrator.config import host_values
from orchestrator.config.host_values import run_dir_for
from orchestrator.config.settings import JobConfig
from orchestrator.config.text import printable, shown
from orchestrator.config.validation import ConfigError
from orchestrator.host.proof import prove_worker
from orchestrator.host.run_folder import worker_status
from orchestrator.host.transport import Transport
from orchestrator.stream.state import StateStore, StreamState
from orchestrator.tracking import tags
from orchestrator.tracking.client import outages_named
from orchestrator.tracking.location import located
from orchestrator.tracking.status import RunStatus


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


def the_run(client: MlflowClient, run_id: str) -> Run:
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
    run = the_run(client, run_id)
    if run.info.status != "RUNNING":
        raise RunEnded(f"run {run_id} has already ended ({run.info.status})")
    where = located(config, run_id, run.data.tags)
    for note in where.notes:
        console.print(f"[yellow]{escape(note)}[/yellow]")
    state = store.load(run_id)
    if state is not None and state.run_dir != where.run_dir:
        launched_into = posixpath.dirname(posixpath.dirname(state.run_dir))
        raise ConfigError(
            f"run {run_id[:8]} was launched from here into {printable(launched_into)}; this command's host.workdir "
            f"is {config.host.workdir}: give {printable(shlex.quote(f'host.workdir={launched_into}'))}"
        )
    if state is None:
        state = state_from_tags(config, run_id, run.data.tags, console)
    started_s_ago = max(0.0, time.time() - run.info.start_time / 1000)
    model = printable(run.data.tags.get(tags.MODEL) or "?")[:80]
    launched = tags.HOST_RUN_DIR in run.data.tags
    return Attached(run.info.experiment_id, state, started_s_ago, model, launched, run.data.tags.get(tags.SLURM_JOB_ID))


def state_from_tags(config: JobConfig, run_id: str, run_tags: dict[str, str], console: Console) -> StreamState:
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


def reach(config: JobConfig, transport: Transport) -> int | None:
    """Connect before touching a run that lives on the host: out of reach is one line (as a run's connect
    failure) and the run is left exactly as it was; None when connected."""
    try:
        transport.open()
    except Exception as exc:  # noqa: BLE001 - ConnectFailed, HostKeyRefused, a socket error: all one line
        print(f"{config.host.name}: {exc}", file=sys.stderr)
        transport.close()
        return RunStatus.FAILED.exit_code
    return None


def proven(config: JobConfig, transport: Transport, found: Attached) -> int | None:
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
