"""`attach=<run>`: follow a run started earlier from where its log was last applied, to its end."""

from __future__ import annotations

from rich.console import Console

from orchestrator.cli import context
from orchestrator.cli.context import TransportFactory
from orchestrator.cli.following import follow_run
from orchestrator.cli.picked_up import attached_state, proven, reach
from orchestrator.config.settings import JobConfig
from orchestrator.config.validation import ConfigError
from orchestrator.lifecycle.job import Job
from orchestrator.lifecycle.phases import (
    check_resume_point,
    conclude,
    follow,
    open_host,
)
from orchestrator.tracking.status import Outcome


def command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """Follow a run started earlier, from where its event log was last read, to its end."""
    client = context.open_tracking(config.tracking)
    store = context.open_state(config)
    found = attached_state(client, store, config, console)
    state = found.state
    if store.lock(state.run_id) is None:
        raise ConfigError(
            f"run {state.run_id} is followed by another orchestrator here (pid {store.holder(state.run_id)}); "
            "stop that one first"
        )
    transport = transport_for(config)
    if (code := reach(config, transport)) is not None or (code := proven(config, transport, found)) is not None:
        store.release(state.run_id)
        return code
    experiment_id, started_s_ago = found.experiment_id, found.started_s_ago
    return follow_run(
        config, console, client, store, transport, experiment_id, state, attach_body, None, started_s_ago, found.model
    )


def attach_body(job: Job) -> Outcome:
    open_host(job, leave_if_unreachable=True)
    job.launched = True
    check_resume_point(job)
    return conclude(job, follow(job))
