"""Which run a command names: a full MLflow run id, a unique prefix of one, or `last`.

`last` is yours: the newest run this user launched from this machine to that host and work folder, as
this user's own state folder records it (`StateStore.launched`), never the newest run the tracking store
shows (anyone who can write there could create a newer one). Where this shell (its session) launched any,
`last` is one of this shell's: another terminal's sweep is never picked over them; `attach` and `cancel`
take the newest one still running. The command says which run it picked,
its name and start time, before acting; `cancel=last` asks first when that run is a sweep's job or another
shell's (`yes=true` answers for it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from rich.console import Console

from orchestrator.config.settings import Command, JobConfig
from orchestrator.config.validation import ConfigError
from orchestrator.stream.state import Launched, StateStore
from orchestrator.tracking import tags
from orchestrator.tracking.client import TrackingUnavailable, outages_named

MAX_RUNS = 1000
RUNNING_LOOKS = 20  # attach and cancel: how many of the newest runs to ask MLflow about, for one still running


def host_runs(client: MlflowClient, host: str) -> list:
    """The job runs of `host` in MLflow (no method children, no sweep parents), newest first."""
    with outages_named():
        experiments = [e.experiment_id for e in client.search_experiments()]
        found = client.search_runs(
            experiments, f"tags.`{tags.HOST}` = '{host}'", max_results=MAX_RUNS, order_by=["attributes.start_time DESC"]
        )
    return [r for r in found if tags.SCOPE not in r.data.tags and tags.ROLE not in r.data.tags]


def find_run(
    client: MlflowClient,
    config: JobConfig,
    store: StateStore | None = None,
    console: Console | None = None,
    ask: Callable[[str], str] = input,
) -> str:
    """The full run id the command line names: itself, the one run of the host whose id starts with it, or
    (with this user's `store`) `last`."""
    reference = str(config.run_id)
    if len(reference) == 32:
        return reference
    if reference == "last":
        if store is None:
            raise ConfigError("last needs this machine's state folder (orchestrator.state_dir)")
        return _last(client, config, store, console or Console(stderr=True), ask)
    matches = [r.info.run_id for r in host_runs(client, config.host.name) if r.info.run_id.startswith(reference)]
    if not matches:
        raise ConfigError(f"no run of host {config.host.name} has an id starting with {reference}")
    if len(matches) > 1:
        raise ConfigError(
            f"{reference} names {len(matches)} runs ({', '.join(m[:8] for m in matches[:4])}…): give more"
        )
    return matches[0]


def _last(
    client: MlflowClient, config: JobConfig, store: StateStore, console: Console, ask: Callable[[str], str]
) -> str:
    here = config.host.workdir
    mine = [r for r in store.launched() if r.host == config.host.name and r.workdir == here]
    if not mine:
        raise ConfigError(
            f"last: you launched no run from this machine to host {config.host.name} in {here} (this state folder: "
            f"{store.root}); name the run by its id"
        )
    session = os.getsid(0)
    pool = [r for r in mine if r.session == session] or mine  # this shell's runs, where it launched any
    chosen = pool[0]
    if config.command in (Command.ATTACH, Command.CANCEL):
        chosen = next((r for r in pool[:RUNNING_LOOKS] if _running(client, r.run_id)), chosen)
    origin = _origin(chosen, session)
    console.print(
        f"last: run {chosen.run_id[:8]} '{chosen.name}', started {_when(chosen.started)} {origin}",
        markup=False,
        highlight=False,
    )
    risky = chosen.sweep_job is not None or chosen.session != session
    if config.command is Command.CANCEL and risky and not config.yes:
        question = f"cancel run {chosen.run_id[:8]} ({origin})? [y/N] "
        if not sys.stdin.isatty():
            raise ConfigError(f"cancel=last picked run {chosen.run_id[:8]} {origin}: add yes=true to cancel it")
        if ask(question).strip().lower() not in ("y", "yes"):
            raise ConfigError(f"run {chosen.run_id[:8]} was not cancelled")
    return chosen.run_id


def _running(client: MlflowClient, run_id: str) -> bool:
    try:
        with outages_named():
            return client.get_run(run_id).info.status == "RUNNING"
    except (MlflowException, TrackingUnavailable):  # gone from the store, or no answer: not one to pick
        return False


def _origin(record: Launched, session: int) -> str:
    shell = "from this shell" if record.session == session else "from another shell"
    return f"{shell}, sweep job #{record.sweep_job}" if record.sweep_job is not None else shell


def _when(started: float) -> str:
    today = time.localtime(started)[:3] == time.localtime()[:3]
    return time.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S", time.localtime(started))
