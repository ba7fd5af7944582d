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
from typing import Any

from orchestrator.config.handover import sh_read, sh_write_whole
from orchestrator.host.leases import CLAIM_SCRATCH, RESERVED, TAKEN
from orchestrator.host.proof import NotProven, prove_worker
from orchestrator.host.run_folder import (
    CANCELLED_FILE,
    ENV_FILE,
    EXIT_CODE_FILE,
    LEASE_FILE,
    PID_FILE,
    SPEC_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    WAITING_FILE,
    WORKER_MARK,
    WorkerStatus,
    worker_status,
)
from orchestrator.host.sync import sh_first_foreign
from orchestrator.host.transport import Transport, UnsafePath
from remote_worker.prompt_set import RUN_PROMPTS_FILE

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
_WRITE_LEASE_END = sh_write_whole(f'"$({sh_read(LEASE_FILE)}) $(date +%s.%N)"', LEASE_FILE)
# The worker's code is held, not named: the snapshot folder (PYTHONPATH) is opened as fd 8, checked through it
# (no link, nothing another user owns or could write: the sync's check, again, on what runs), and the worker
# imports through /dev/fd/8, its own inherited descriptor. The sync's check ran by name, seconds earlier; a
# work folder others may write could have had its `code` folder swapped for a planted copy since.
# (With $3 = `checkout`, this machine's own checkout, the code is run as it is.)
_HOLD_CODE = (
    'if [ "$held" = snapshot ]; then '
    '[ -d "$PYTHONPATH" ] || { echo "ddtree-worker: the code folder $PYTHONPATH is gone" >&2; exit 126; }; '
    'exec 8<"$PYTHONPATH"; '
    f"bad=$({sh_first_foreign('/dev/fd/8/.')}); "
    'if [ -n "$bad" ] || [ ! -d /dev/fd/8/. ]; then echo "ddtree-worker: not run from $PYTHONPATH: '
    '$PYTHONPATH${bad#/dev/fd/8/.} is a link, not yours, or writable by others" >&2; exit 126; fi; '
    "export PYTHONPATH=/dev/fd/8; fi; "
)
_SUPERVISE = (
    f"{sh_write_whole('$$', PID_FILE)}; "
    f"if [ -e {CANCELLED_FILE} ]; then rm -f {ENV_FILE}; {sh_write_whole('143', EXIT_CODE_FILE)}; exit 0; fi; "
    f"if [ -L {ENV_FILE} ] || ! worker_env=$({sh_read(ENV_FILE)}) || [ ! -f {ENV_FILE} ]; then "
    f"rm -f {ENV_FILE}; {sh_write_whole('1', EXIT_CODE_FILE)}; exit 1; fi; "
    f"rm -f {ENV_FILE}; "
    "gpus=$1; locks=$2; held=$3; mask=$4; shift 4; "
    'if [ -n "$gpus" ]; then [ -d "$locks" ] || { (umask "$mask"; mkdir -p "$locks") && chmod 1777 "$locks"; } '
    "2>/dev/null; lease=; "
    'while [ -z "$lease" ]; do for g in $gpus; do f="$locks/gpu$g.lock"; '
    '[ -e "$f" ] || (umask 0; : >> "$f"); exec 9<"$f"; '
    "if flock -n 9; then lease=$g; break; fi; exec 9<&-; done; "
    f'[ -n "$lease" ] || {{ {_WRITE_WAITING}; sleep 1; }}; done; '
    f'for r in "$locks/gpu$lease.{RESERVED}".*; do [ -e "$r" ] && {sh_write_whole("0", TAKEN, CLAIM_SCRATCH)}; '
    "break; done 2>/dev/null; "
    f"{_WRITE_LEASE}; rm -f {WAITING_FILE}; "
    "export CUDA_VISIBLE_DEVICES=$lease; fi; "
    f'(umask "$mask"; eval "$worker_env" || exit $?; {_HOLD_CODE}exec "$@"); code=$?; '
    f'if [ -n "$gpus" ]; then {_WRITE_LEASE_END}; fi; '
    f"{sh_write_whole('$code', EXIT_CODE_FILE)}"
)
# The supervisor's `$0` names the run (`ddtree-worker:<run id>`), so its command line carries the run id: the
# proof that a pid is this run's worker (`proof.py`) looks for it there before anything is signalled. The
# streams are created exclusively (`set -C`): a link planted at stdout.log or stderr.log is not written through.
# The supervisor's own files (streams, pid, lease, exit code) are its user's alone (umask 077) whatever the
# host's umask (002 on many shared hosts); the worker runs under the host's own, as it would from a shell: a
# team's shared model cache stays readable by the team.
_DETACH = (
    'cd "$1" || exit 1; run=$2; gpus=$3; locks=$4; held=$5; shift 5; set -C; mask=$(umask); umask 077; '
    f'setsid sh -c \'{_SUPERVISE}\' "{WORKER_MARK}$run" "$gpus" "$locks" "$held" "$mask" "$@" < /dev/null '
    f"> {STDOUT_FILE} 2> {STDERR_FILE} &"
)


def write_spec(
    transport: Transport,
    run_dir: str,
    spec: Mapping[str, Any],
    prompts: str | None = None,
    files: Mapping[str, bytes] | None = None,
) -> None:
    """The run folder with its spec and, when the orchestrator chose the prompts, their copy; `files`: others
    the spec names (an earlier run's phase 1), by name in the run folder."""
    transport.make_dirs(posixpath.dirname(run_dir), 0o700)
    transport.make_dirs(run_dir, 0o700)
    if prompts is not None:
        transport.write_file(posixpath.join(run_dir, RUN_PROMPTS_FILE), prompts.encode(), 0o600)
    for name, data in (files or {}).items():
        transport.write_file(posixpath.join(run_dir, name), data, 0o600)
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
    held: bool = True,
) -> None:
    """Launch `python -m remote_worker run spec.json` detached in `run_dir`; returns at once.

    `env` (and PYTHONPATH=`code_dir`) reach the worker through worker.env, never a command line; the file
    is gone by the time the worker runs. With `gpus`, the worker first leases one of them (a lock in
    `locks_dir`) and sees only that one. `held`: `code_dir` is a snapshot in the work folder, opened and
    checked by the supervisor and imported through its descriptor (False: this machine's checkout)."""
    variables = {**{str(name): str(value) for name, value in env.items()}, "PYTHONPATH": code_dir}
    for name in variables:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"not a valid environment variable name for the worker: {name!r}")
    lines = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in variables.items())
    env_file = posixpath.join(run_dir, ENV_FILE)
    if not transport.create_file(env_file, lines.encode(), 0o600):  # new, or something else is at its name
        raise UnsafePath(f"{env_file} exists already (left by another launch, or planted); the worker's "
                         "secrets are not written there")  # fmt: skip
    candidates = " ".join(str(int(g)) for g in gpus)
    argv = ["sh", "-c", _DETACH, "launch", run_dir, posixpath.basename(run_dir), candidates, locks_dir]
    argv.append("snapshot" if held else "checkout")
    argv += [python, "-m", "remote_worker", "run", SPEC_FILE]
    transport.run(argv)


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
    """Whether the process group ended within `timeout_s`: gone only when `kill -0` says so (its exit 1). A
    `kill` that was itself killed is no answer: Slurm cancelling a step signals every process in it, the
    `kill` just forked included, and reading that as "gone" once left a live worker and its run RUNNING."""
    deadline = time.monotonic() + timeout_s
    while (code := transport.run(["kill", "-0", group], check=False).exit_code) != 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1 if code == 0 else 0.02)
    return True


_CANCEL = (
    f'cd "$1" 2>/dev/null || exit 0; dd of={CANCELLED_FILE} conv=excl oflag=nofollow status=none </dev/null '
    f"2>/dev/null; rm -f {ENV_FILE}"
)


def forget_env(transport: Transport, run_dir: str) -> None:
    """Remove worker.env, which holds the worker's secrets: the supervisor deletes it once read, so it is left
    only by a launch that failed before the supervisor ran (whoever learns of that removes it)."""
    transport.run(["rm", "-f", posixpath.join(run_dir, ENV_FILE)])


def stop_worker(transport: Transport, run_dir: str, grace_s: float) -> WorkerStatus:
    """SIGTERM the worker's process group, then SIGKILL it after `grace_s`; return the final status.

    A worker stopped before its supervisor wrote a pid (still `starting`) is cancelled by a marker file the
    supervisor reads right after writing its pid; the pid is looked for once more after the marker, so
    whichever of the two came first, the worker never runs unstopped (and its worker.env is removed).

    Nothing is signalled that `proof.prove_worker` does not prove the run's own (the pid file is a claim, and
    a group we did not start is never signalled): then `NotProven` names what did not match."""
    status = worker_status(transport, run_dir)
    if status.state == "starting":
        transport.run(["sh", "-c", _CANCEL, "cancel", run_dir], check=False)
        status = worker_status(transport, run_dir)
    if status.state not in ("running", "waiting") or status.pid is None:
        if status.state != "missing":
            forget_env(transport, run_dir)
        return status
    workdir, run_id = posixpath.dirname(posixpath.dirname(run_dir)), posixpath.basename(run_dir)
    proof = prove_worker(transport, workdir, run_id, status)
    if proof.problem is not None:
        raise NotProven(f"the worker of run {run_id[:8]} was not signalled: {proof.problem}")
    group = f"-{status.pid}"  # `kill -SIG -PGID` (no `--`: dash's builtin kill rejects it)
    transport.run(["kill", "-TERM", group], check=False)
    if not _wait_until_gone(transport, group, grace_s):
        transport.run(["kill", "-KILL", group], check=False)
        _wait_until_gone(transport, group, 10.0)
    return worker_status(transport, run_dir)
