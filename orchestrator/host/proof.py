"""Proof that a folder and a process belong to a run, before anything acts on them.

A run's tags name where it lives and its pid file names its worker, but a tracking server may have no
authentication and a work folder may be shared: either can be made to name someone else's folder or an
unrelated process (`kill -TERM -1` would signal everything the user may signal). So before `cancel=`
signals anything and before `attach=` applies or uploads anything, the host is asked for facts and they are
checked here:

- the run folder is `host.workdir/runs/<run id>` (the configured work folder, never a tag's), reached
  without a link, owned by the user and writable by no one else;
- its own `spec.json` names the run id;
- the pid is above 1, its process is alive and the user's, leads its own process group (the group a signal
  goes to is one the run started: `setsid`), started no earlier than the run's spec was written, and
  carries the run id on its command line (the supervisor's `$0` is `ddtree-worker:<run id>`).

Anything else is one line naming what did not match, and nothing is signalled or uploaded.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from orchestrator.host.run_folder import PID_FILE, SPEC_FILE, WORKER_MARK, WorkerStatus
from orchestrator.host.ssh_files import WALK
from orchestrator.host.transport import Transport, UnsafePath


class NotProven(Exception):
    """A folder or process that is not proven the run's: the message says what did not match (not an OSError:
    it is a refusal, never retried as a lost connection)."""


START_SLACK_S = 2  # the boot time /proc gives is whole seconds: a start may read up to this much early

# $1 the work folder, $2 the run id. Prints what the host shows of the run's folder and of the process its
# pid file names; it decides nothing (`RunFacts.problem` does).
_FACTS = (
    WALK + 'run=$2; walk "$1" "runs/$run" 0 0; r=$?; '
    'if [ $r = 4 ]; then echo "folder link"; exit 0; elif [ $r != 0 ]; then echo "folder missing"; exit 0; fi; '
    'echo "me $(id -u)"; echo "folder $(stat -c "%u %a" .)"; '
    f'[ -f {SPEC_FILE} ] && [ ! -L {SPEC_FILE} ] && echo "spec_time $(stat -c %Y {SPEC_FILE})"; '
    f"pid=$(dd if={PID_FILE} iflag=nofollow,nonblock status=none 2>/dev/null); "
    'case $pid in ""|*[!0-9]*) exit 0;; esac; echo "pid $pid"; '
    '[ "$pid" -gt 1 ] && [ -r "/proc/$pid/stat" ] || exit 0; '
    "uid=$(awk '/^Uid:/ {print $2}' \"/proc/$pid/status\" 2>/dev/null); "
    'line=$(cat "/proc/$pid/stat" 2>/dev/null) || exit 0; rest=${line##*) }; set -- $rest; '
    "hz=$(getconf CLK_TCK); btime=$(awk '/^btime/ {print $2}' /proc/stat); "
    'echo "proc $uid $3 $4 $((btime + ${20} / hz))"; '
    f'tr "\\000" "\\n" < "/proc/$pid/cmdline" 2>/dev/null | grep -qxF -- "{WORKER_MARK}$run" && echo carries; '
    "exit 0"
)


@dataclass(frozen=True)
class RunFacts:
    """What the host showed of a run's folder and of the process its pid file names."""

    folder: str  # ok, missing, link
    me: int | None = None
    owner: int | None = None
    mode: int | None = None
    spec_time: int | None = None
    pid: int | None = None
    proc_uid: int | None = None
    pgrp: int | None = None
    session: int | None = None
    started: int | None = None  # unix seconds
    carries: bool = False

    @classmethod
    def parse(cls, text: str) -> RunFacts:
        answer: dict[str, list[str]] = {}
        for line in text.splitlines():
            key, _, value = line.strip().partition(" ")
            answer.setdefault(key, value.split())
        folder = answer.get("folder", ["missing"])

        def number(words: list[str] | None, index: int = 0, base: int = 10) -> int | None:
            try:
                return int(words[index], base) if words else None
            except (ValueError, IndexError):
                return None

        if folder[0] in ("missing", "link"):
            return cls(folder[0])
        proc = answer.get("proc")
        return cls(
            "ok",
            me=number(answer.get("me")),
            owner=number(folder),
            mode=number(folder, 1, 8),
            spec_time=number(answer.get("spec_time")),
            pid=number(answer.get("pid")),
            proc_uid=number(proc),
            pgrp=number(proc, 1),
            session=number(proc, 2),
            started=number(proc, 3),
            carries="carries" in answer,
        )

    def folder_problem(self, run_dir: str) -> str | None:
        """Why the folder is not to be trusted as the run's; None when it is."""
        if self.folder == "missing":
            return f"{run_dir} does not exist"
        if self.folder == "link":
            return f"{run_dir} (or a folder on its way from host.workdir) is a symbolic link"
        if self.owner is None or self.me is None or self.owner != self.me:
            return f"{run_dir} is owned by uid {self.owner}, not by you (uid {self.me})"
        if self.mode is None or self.mode & 0o022:
            return f"{run_dir} is writable by others (mode {self.mode or 0:o})"
        return None

    def process_problem(self, run_id: str) -> str | None:
        """Why the process the pid file names is not to be signalled as the run's worker; None when it may be."""
        pid = self.pid
        if pid is None:
            return "its pid file names no process"
        if pid <= 1:
            return f"its pid file names pid {pid}, which is never signalled"
        if self.proc_uid is None:
            return f"pid {pid} is not alive"
        if self.proc_uid != self.me:
            return f"pid {pid} belongs to uid {self.proc_uid}, not to you (uid {self.me})"
        if self.pgrp != pid or self.session != pid:
            return f"pid {pid} does not lead its own process group (group {self.pgrp}): not a group the run started"
        if self.spec_time is not None and self.started is not None and self.started + START_SLACK_S < self.spec_time:
            return f"pid {pid} started before the run's folder was written"
        if not self.carries:
            return f"pid {pid} does not carry the run id {run_id[:8]} on its command line"
        return None


@dataclass(frozen=True)
class Proof:
    """The host's answer for one run: what did not match (None: the folder, and the worker if alive, are the
    run's own) and the facts behind it."""

    problem: str | None
    facts: RunFacts


def run_facts(transport: Transport, workdir: str, run_id: str) -> RunFacts:
    return RunFacts.parse(transport.run(["sh", "-c", _FACTS, "run-facts", workdir, run_id]).stdout)


def prove_folder(transport: Transport, workdir: str, run_id: str) -> Proof:
    """Whether `workdir/runs/<run_id>` is the run's own folder (and names it in its spec)."""
    run_dir = posixpath.join(workdir, "runs", run_id)
    facts = run_facts(transport, workdir, run_id)
    problem = facts.folder_problem(run_dir)
    if problem is None:
        problem = _spec_problem(transport, run_dir, run_id)
    return Proof(problem, facts)


def _spec_problem(transport: Transport, run_dir: str, run_id: str) -> str | None:
    path = posixpath.join(run_dir, SPEC_FILE)
    try:
        raw = transport.read_bytes(path, 0, 1 << 20)
    except UnsafePath as refused:
        return str(refused)
    if not raw:
        return f"{path} is missing"
    try:
        named = json.loads(raw).get("run_id")
    except (ValueError, AttributeError):
        return f"{path} is not a spec file"
    if named != run_id:
        return f"{path} names run {str(named)[:40]!r}, not {run_id}"
    return None


def prove_worker(transport: Transport, workdir: str, run_id: str, status: WorkerStatus) -> Proof:
    """Whether the live worker `status` names may be signalled as the run's: the folder's proof, then the
    process's (a worker that is not alive needs none)."""
    proof = prove_folder(transport, workdir, run_id)
    if proof.problem is not None or not status.alive or status.pid is None:
        return proof
    if proof.facts.pid != status.pid:  # the pid file changed between the two looks: look again next time
        return Proof(f"its pid file changed while it was checked ({status.pid} → {proof.facts.pid})", proof.facts)
    return Proof(proof.facts.process_problem(run_id), proof.facts)
