"""`logs=<run>`: the worker's stderr and its log lines; with `follow=true`, new ones until the worker ends."""

from __future__ import annotations

import posixpath
import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape

from orchestrator.cli import context
from orchestrator.cli.context import TransportFactory
from orchestrator.cli.picked_up import the_run
from orchestrator.cli.run_ref import find_run
from orchestrator.config.host_values import run_dir_for
from orchestrator.config.settings import JobConfig
from orchestrator.config.text import printable
from orchestrator.host.proof import prove_folder
from orchestrator.host.run_folder import STDERR_FILE, worker_status
from orchestrator.host.transport import Transport, UnsafePath
from orchestrator.lifecycle.interrupt import CtrlC
from orchestrator.lifecycle.job import CANCEL_REQUEST_FILE
from orchestrator.stream.events import EVENTS_FILE, parse_chunk
from orchestrator.tracking import tags
from orchestrator.tracking.client import TrackingUnavailable
from orchestrator.tracking.location import located
from orchestrator.tracking.status import RunStatus


def command(config: JobConfig, console: Console, transport_for: TransportFactory) -> int:
    """The worker's stderr and log lines (follow=true: until the worker ends; Ctrl-C stops reading only).

    The run's folder is `host.workdir/runs/<run id>` of the configured work folder (its tags are checked
    against the config, `tracking/location.py`); without MLflow, a full run id is looked for there. Nothing is
    printed from a folder the host does not prove the run's own (`host/proof.py`)."""
    run_id = str(config.run_id)
    try:
        client = context.open_tracking(config.tracking)
    except TrackingUnavailable as exc:
        if len(run_id) != 32:
            raise
        console.print(f"[yellow]{exc}: looking for the run in {config.host.workdir}[/yellow]")
    else:
        run_id = find_run(client, config, context.open_state(config), console)
        run = the_run(client, run_id)
        for note in located(config, run_id, run.data.tags).notes:
            console.print(f"[yellow]{escape(note)}[/yellow]")
        model = printable(run.data.tags.get(tags.MODEL, "?"))[:60]
        console.print(f"logs of run {run_id[:8]} on {config.host.name} · {model} · {run.info.status}", markup=False,
                      highlight=False)  # fmt: skip
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


# -- the log, as it comes -----------------------------------------------------------------------------------


def _how_it_ended(transport: Transport, run_dir: str) -> str:
    """`the worker has ended: worker exited with code 0`, and `(cancelled by the user)` where `cancel=` marked it."""
    status = worker_status(transport, run_dir)
    try:
        marked = transport.read_bytes(posixpath.join(run_dir, CANCEL_REQUEST_FILE), 0, 200).decode(errors="replace")
    except UnsafePath:
        marked = ""
    return f"the worker has ended: {status.describe()}" + (f" ({printable(marked.strip())})" if marked.strip() else "")


def print_logs(
    console: Console,
    transport: Transport,
    run_dir: str,
    follow: bool,
    poll_interval_s: float,
    check_interrupt: Callable[[], None],
    name: str = "the run",
) -> int:
    """The worker's stderr, then its `log` and `traceback` events; with `follow`, new lines as they come,
    until the worker is gone. A run with no folder there is one line and exit code 1; one whose worker has
    written nothing says so."""
    if worker_status(transport, run_dir).state == "missing":
        print(f"{name} has no folder at {run_dir}: no logs", file=sys.stderr)
        return 1
    printed = False
    stderr_at = events_at = 0
    stderr_path, events_path = posixpath.join(run_dir, STDERR_FILE), posixpath.join(run_dir, EVENTS_FILE)
    while True:
        gone = follow and not worker_status(transport, run_dir).alive  # asked first: what follows is all
        while True:  # everything written so far (whole lines while the worker may still add to them)
            stderr = transport.read_bytes(stderr_path, stderr_at, 1 << 20)
            end = stderr.rfind(b"\n") + 1 if follow and not gone else len(stderr)
            for line in stderr[:end].decode(errors="replace").splitlines():
                console.print(
                    f"stderr  {printable(line, keep_tabs=True)}", markup=False, highlight=False, soft_wrap=True
                )
                printed = True
            stderr_at += end
            chunk = transport.read_bytes(events_path, events_at, 4 << 20)
            events, _bad, consumed = parse_chunk(chunk, events_at)
            events_at += consumed
            for event in events:
                data = event.data if isinstance(event.data, dict) else {"message": event.data}
                if event.kind in ("log", "traceback"):
                    when = time.strftime("%H:%M:%S", time.localtime(event.t))
                    text = printable(data.get("message") or data.get("error") or "", keep_tabs=True)
                    console.print(f"{when} {event.kind:<9} {text}", markup=False, highlight=False, soft_wrap=True)
                    printed = True
            if end == 0 and consumed == 0:
                break
        if not follow or gone:
            if not printed:
                console.print(f"{name}: the worker has written no log line and nothing to stderr", style="dim")
            if gone:  # following ends because the worker did: say how
                console.print(f"{name}: {_how_it_ended(transport, run_dir)}", markup=False, highlight=False)
            return 0
        check_interrupt()
        time.sleep(poll_interval_s)
