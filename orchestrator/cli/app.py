"""The entry point's one function: validate the config, then run the command it asks for (`COMMANDS`), each in
a module of its own: `run.py` (run, detach), `attach.py`, `cancel.py`, `logs.py`, `listing.py` (list).

What can go wrong before a run exists is one line and an exit code: 2 for a config mistake, 1 for a tracking
store that does not answer or a state folder that cannot be written; nothing is created on the host.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console

from orchestrator.cli import attach, cancel, context, listing, logs, run
from orchestrator.cli.context import TransportFactory
from orchestrator.config.commands import carried
from orchestrator.config.redaction import redact_text
from orchestrator.config.settings import Command, JobConfig
from orchestrator.config.validation import ConfigError, validate
from orchestrator.host.connect import transport_for
from orchestrator.host.transport import Transport
from orchestrator.lifecycle.errors import LocalFailure
from orchestrator.sweep import assign_host, record_job_error
from orchestrator.tracking.client import TrackingUnavailable
from orchestrator.tracking.status import CONFIG_ERROR_EXIT

CANNOT_BEGIN_EXIT = 1


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
    context.keep_hydra_files_secret()
    console = Console()
    try:
        overrides = context.task_overrides()
        config = validate(assign_host(cfg))
        printed = carried(overrides, config.resolved)
        config = replace(config, carried=printed)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        record_job_error(f"config error: {exc}")
        return CONFIG_ERROR_EXIT
    if config.dry_run:  # a multirun's dry run ends in its callback, before any job: this is a single run's
        console.print("dry run: the config checks; nothing started (drop sweep.dry_run to run it)", markup=False)
        return 0
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


COMMANDS = {
    Command.RUN: run.command,
    Command.DETACH: run.command,
    Command.ATTACH: attach.command,
    Command.CANCEL: cancel.command,
    Command.LOGS: logs.command,
    Command.LIST: listing.command,
}
