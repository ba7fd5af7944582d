"""Start the worker detached on a host, ask how it is doing, and stop it.

The worker runs in its own session (`setsid`) with all three streams redirected, so it outlives the
connection that started it. Its session leader is a small `sh` that writes `pid` before running the
worker and `exit_code` after it, so a death without an `end` event (SIGKILL, out of memory) is still seen.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.config.handover import sh_write_whole
from orchestrator.host.leases import CLAIM_SCRATCH, RESERVED, TAKEN
from orchestrator.host.transport import Transport
from remote_worker.prompt_set import RUN_PROMPTS_FILE

SPEC_FILE = "spec.json"
PID_FILE = "pid"
EXIT_CODE_FILE = "exit_code"
LEASE_FILE = "gpu_lease"  # "<gpu index> <unix time the lease began>[ <unix time the worker ended>]"
WAITING_FILE = "waiting_for_gpu"
CANCELLED_FILE = "cancelled"  # stopped before it had a pid: the supervisor exits as soon as it starts
ENV_FILE = "worker.env"  # the worker's variables, read and deleted by the supervisor before anything else
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Fixed scripts: every value reaches them as a positional argument, never spliced into the text.
# The worker's environment (secrets such as HF_TOKEN included) is in none of those arguments, which any user of
# the host can read in its process list: `start_worker` writes it to worker.env (0600, over SFTP on an SSH host),
# and the supervisor, first thing, reads that file into a shell variable and deletes it; the worker's subshell
# evaluates the variable just before it `exec`s the worker, so the values reach the worker's environment only,
# with the same precedence as before (after the supervisor's CUDA_VISIBLE_DEVICES, PYTHONPATH last).
# The supervisor leases a GPU first when given candidates ($1, space-separated; locks in $2): `flock` on
# <locks>/gpu<N>.lock through fd 9, which the worker inherits, so the lease lasts exactly as long as the
# worker's process group, however it ends. No free GPU: it waits, and says so in a file the status reads.
# The lock folder is shared by every user of the host (sticky and world-writable, like /tmp); a lock file
# is opened read-only, so another user's file locks as well as one's own. A lease taken ends the claim a pool's
# job may hold on that GPU (`leases.py`): 0 in this user's reservation file, the newest, means taken.
# Every file the status script reads is written whole (`sh_write_whole`): a status read between `>` and the
# echo saw an empty pid and called a live worker vanished.
_WRITE_WAITING = sh_write_whole('"$gpus"', WAITING_FILE)
_WRITE_LEASE = sh_write_whole('"$lease $(date +%s.%N)"', LEASE_FILE)
_WRITE_LEASE_END = sh_write_whole(f'"$(cat {LEASE_FILE}) $(date +%s.%N)"', LEASE_FILE)
_SUPERVISE = (
    f"{sh_write_whole('$$', PID_FILE)}; "
    f"if [ -e {CANCELLED_FILE} ]; then rm -f {ENV_FILE}; {sh_write_whole('143', EXIT_CODE_FILE)}; exit 0; fi; "
    f"if ! worker_env=$(cat {ENV_FILE}); then {sh_write_whole('1', EXIT_CODE_FILE)}; exit 1; fi; "
    f"rm -f {ENV_FILE}; "
    "gpus=$1; locks=$2; shift 2; "
    'if [ -n "$gpus" ]; then [ -d "$locks" ] || { mkdir -p "$locks" && chmod 1777 "$locks"; } 2>/dev/null; lease=; '
    'while [ -z "$lease" ]; do for g in $gpus; do f="$locks/gpu$g.lock"; '
    '[ -e "$f" ] || (umask 0; : >> "$f"); exec 9<"$f"; '
    "if flock -n 9; then lease=$g; break; fi; exec 9<&-; done; "
    f'[ -n "$lease" ] || {{ {_WRITE_WAITING}; sleep 1; }}; done; '
    f'for r in "$locks/gpu$lease.{RESERVED}".*; do [ -e "$r" ] && {sh_write_whole("0", TAKEN, CLAIM_SCRATCH)}; '
    "break; done 2>/dev/null; "
    f"{_WRITE_LEASE}; rm -f {WAITING_FILE}; "
    "export CUDA_VISIBLE_DEVICES=$lease; fi; "
    '(eval "$worker_env" && exec "$@"); code=$?; '
    f'if [ -n "$gpus" ]; then {_WRITE_LEASE_END}; fi; '
    f"{sh_write_whole('$code', EXIT_CODE_FILE)}"
)
_DETACH = (
    'cd "$1" || exit 1; shift; '
    f"setsid sh -c '{_SUPERVISE}' worker \"$@\" < /dev/null > {STDOUT_FILE} 2> {STDERR_FILE} &"
)
_STATUS = (
    'cd "$1" 2>/dev/null || { echo missing; exit 0; }; '
    f"if [ -f {EXIT_CODE_FILE} ]; then echo exited $(cat {EXIT_CODE_FILE}); "
    f'elif [ -f {PID_FILE} ] && kill -0 -"$(cat {PID_FILE})" 2>/dev/null; then '
    f"if [ -f {WAITING_FILE} ]; then echo waiting $(cat {PID_FILE}); else echo running $(cat {PID_FILE}); fi; "
    f"elif [ -f {PID_FILE} ]; then echo vanished $(cat {PID_FILE}); "
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


def run_dir_for(workdir: str, run_id: str) -> str:
    return posixpath.join(workdir, "runs", run_id)


def write_spec(transport: Transport, run_dir: str, spec: Mapping[str, Any], prompts: str | None = None) -> None:
    """The run folder with its spec and, when the orchestrator chose the prompts, their copy."""
    transport.make_dirs(posixpath.dirname(run_dir), 0o700)
    transport.make_dirs(run_dir, 0o700)
    if prompts is not None:
        transport.write_file(posixpath.join(run_dir, RUN_PROMPTS_FILE), prompts.encode(), 0o600)
    data = (json.dumps(spec, indent=1, sort_keys=True) + "\n").encode()
    transport.write_file(posixpath.join(run_dir, SPEC_FILE), data, 0o600)


def start_worker(
    transport: Transport,
    run_dir: str,
    python: str,
    code_dir: str,
    env: Mapping[str, str],
    gpus: Sequence[int] = (),
    locks_dir: str = "",
) -> None:
    """Launch `python -m remote_worker run spec.json` detached in `run_dir`; returns at once.

    `env` (and PYTHONPATH=`code_dir`) reach the worker through worker.env, never a command line; the file
    is gone by the time the worker runs. With `gpus`, the worker first leases one of them (a lock in
    `locks_dir`) and sees only that one."""
    variables = {**{str(name): str(value) for name, value in env.items()}, "PYTHONPATH": code_dir}
    for name in variables:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"not a valid environment variable name for the worker: {name!r}")
    lines = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in variables.items())
    transport.write_file(posixpath.join(run_dir, ENV_FILE), lines.encode(), 0o600)
    candidates = " ".join(str(int(g)) for g in gpus)
    argv = ["sh", "-c", _DETACH, "launch", run_dir, candidates, locks_dir]
    argv += [python, "-m", "remote_worker", "run", SPEC_FILE]
    transport.run(argv)


def worker_status(transport: Transport, run_dir: str) -> WorkerStatus:
    words = transport.run(["sh", "-c", _STATUS, "status", run_dir]).stdout.split()
    state = words[0] if words else "missing"
    number = int(words[1]) if len(words) > 1 and words[1].lstrip("-").isdigit() else None
    if state == "exited":
        return WorkerStatus(state, exit_code=number)
    return WorkerStatus(state, pid=number)


def wait_for_start(
    transport: Transport, run_dir: str, timeout_s: float = 30.0, check_interrupt: Callable[[], None] = lambda: None
) -> WorkerStatus:
    """Wait until the supervisor has written its pid (or already finished); still `starting` after
    `timeout_s` means it never started. `check_interrupt` is called between looks (a swallowed Ctrl-C)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = worker_status(transport, run_dir)
        if status.state != "starting" or time.monotonic() > deadline:
            return status
        check_interrupt()
        time.sleep(0.05)


def _wait_until_gone(transport: Transport, group: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while transport.run(["kill", "-0", group], check=False).exit_code == 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


_CANCEL = f'cd "$1" 2>/dev/null || exit 0; : > {CANCELLED_FILE}; rm -f {ENV_FILE}'


def forget_env(transport: Transport, run_dir: str) -> None:
    """Remove worker.env, which holds the worker's secrets: the supervisor deletes it once read, so it is left
    only by a launch that failed before the supervisor ran (whoever learns of that removes it)."""
    transport.run(["rm", "-f", posixpath.join(run_dir, ENV_FILE)])


def stop_worker(transport: Transport, run_dir: str, grace_s: float) -> WorkerStatus:
    """SIGTERM the worker's process group, then SIGKILL it after `grace_s`; return the final status.

    A worker stopped before its supervisor wrote a pid (still `starting`) is cancelled by a marker file the
    supervisor reads right after writing its pid; the pid is looked for once more after the marker, so
    whichever of the two came first, the worker never runs unstopped (and its worker.env is removed)."""
    status = worker_status(transport, run_dir)
    if status.state == "starting":
        transport.run(["sh", "-c", _CANCEL, "cancel", run_dir], check=False)
        status = worker_status(transport, run_dir)
    if status.state not in ("running", "waiting") or status.pid is None:
        if status.state != "missing":
            forget_env(transport, run_dir)
        return status
    group = f"-{status.pid}"  # `kill -SIG -PGID` (no `--`: dash's builtin kill rejects it)
    transport.run(["kill", "-TERM", group], check=False)
    if not _wait_until_gone(transport, group, grace_s):
        transport.run(["kill", "-KILL", group], check=False)
        _wait_until_gone(transport, group, 10.0)
    return worker_status(transport, run_dir)
