"""A run's folder on its host: the names of the files in it, and the worker's state as they show it.

The folder is `host.workdir/runs/<run id>/`: the spec and prompts the orchestrator writes, the supervisor's
pid, exit code and GPU lease, the worker's event log and streams. Every script that reads them reads without
following a link (`sh_read`), and every one that writes them writes whole (`sh_write_whole`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from orchestrator.config.handover import sh_read
from orchestrator.host.transport import CommandFailed, Transport

SPEC_FILE = "spec.json"
PID_FILE = "pid"
EXIT_CODE_FILE = "exit_code"
LEASE_FILE = "gpu_lease"  # "<gpu index> <unix time the lease began>[ <unix time the worker ended>]"
WAITING_FILE = "waiting_for_gpu"
CANCELLED_FILE = "cancelled"  # stopped before it had a pid: the supervisor exits as soon as it starts
ENV_FILE = "worker.env"  # the worker's variables, read and deleted by the supervisor before anything else
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
WORKER_MARK = "ddtree-worker:"  # the supervisor's $0, before the run id: what `proof.py` looks for

_STATUS = (
    'cd "$1" 2>/dev/null || { echo missing; exit 0; }; '
    f"code=$({sh_read(EXIT_CODE_FILE)}); pid=$({sh_read(PID_FILE)}); "
    "case $pid in *[!0-9]*) pid=;; esac; "
    'if [ -n "$code" ]; then echo exited $code; '
    'elif [ -n "$pid" ] && [ "$pid" -gt 1 ] && kill -0 -"$pid" 2>/dev/null; then '
    f"if [ -f {WAITING_FILE} ]; then echo waiting $pid; else echo running $pid; fi; "
    'elif [ -n "$pid" ]; then echo vanished $pid; '
    f"elif [ -s {STDERR_FILE} ]; then echo unstarted; "
    "else echo starting; fi"
)


@dataclass(frozen=True)
class WorkerStatus:
    """`state` is one of starting, waiting (for a GPU), running, exited, vanished, missing, unstarted.

    `unstarted`: no pid, and the start command wrote to stderr.log. The supervisor writes its pid before
    anything else can print, so anything there first is the start command's own failure (`setsid: not
    found`): the run fails on it at once instead of waiting out `orchestrator.start_timeout_s`."""

    state: str
    pid: int | None = None
    exit_code: int | None = None

    @property
    def alive(self) -> bool:
        return self.state in ("starting", "waiting", "running")

    def describe(self) -> str:
        if self.state == "exited" and self.exit_code is not None:
            if self.exit_code > 128:
                return f"worker was killed by signal {self.exit_code - 128} (exit code {self.exit_code})"
            return f"worker exited with code {self.exit_code}"
        if self.state == "vanished":
            return "worker process group disappeared without writing an exit code (killed, or the host rebooted)"
        if self.state == "missing":
            return "the run directory is gone from the host"
        if self.state == "unstarted":
            return "the start command failed before the worker had a pid (see stderr.log)"
        return f"worker is {self.state}"


# A local command killed by SIGTERM (-15 as Invoke reports it, 143 from a shell): Slurm's scancel signals every
# process of the job's step at once, so a status read in flight dies with the orchestrator's own SIGTERM.
_TERMINATED = (-signal.SIGTERM, 128 + signal.SIGTERM)


def worker_status(transport: Transport, run_dir: str) -> WorkerStatus:
    """The worker's state as its run folder tells it. A read killed by the job's SIGTERM (above) is asked once
    more: it only reads, and the signal was meant for the orchestrator, which is now stopping the worker."""
    argv = ["sh", "-c", _STATUS, "status", run_dir]
    result = transport.run(argv, check=False)
    if result.exit_code in _TERMINATED:
        result = transport.run(argv, check=False)
    if not result.ok:
        raise CommandFailed(argv, result)
    words = result.stdout.split()
    state = words[0] if words else "missing"
    number = int(words[1]) if len(words) > 1 and words[1].lstrip("-").isdigit() else None
    if state == "exited":
        return WorkerStatus(state, exit_code=number)
    return WorkerStatus(state, pid=number)
