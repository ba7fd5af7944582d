"""A sweep job run by Slurm (`hydra/launcher=submitit_slurm`): who it is, and what Slurm's signals mean.

The job follows its worker from the node Slurm gave it (`host=local`); the worker runs in a session of its
own (`setsid`), which a cluster that tracks processes by process group (`proctrack/pgid`) or misses a
re-parented process may not stop with the job. So the job stops it itself: Slurm's SIGTERM raises
`SlurmStopped` in the job, the lifecycle stops the worker (SIGTERM, then SIGKILL within
`STOP_GRACE_S`, well inside Slurm's KillWait), and the run ends with what Slurm meant:

| Slurm did                         | `scontrol show job` then says           | the run                          |
| --------------------------------- | --------------------------------------- | -------------------------------- |
| `scancel`                         | same `Restarts`, no time-limit reason   | KILLED, `cancelled by Slurm …`   |
| the job ran past `--time`         | `Reason=TimeLimit` (or RunTime ≥ limit) | FAILED, `Slurm time limit …`     |
| requeued it (`scontrol requeue`,  | `Restarts` above the job's own count    | stays RUNNING, resumed by the    |
| a preemption)                     |                                         | job when Slurm starts it again   |

SIGUSR2 is ignored, by the job and by everything it starts. submitit asks Slurm for it (`--signal=USR2@`
`signal_delay_s`) as a warning before the time limit, to checkpoint and requeue; Slurm sends it to every
process of the job step, and its default action kills: the worker (a descendant Slurm tracks) and any
command the job runs at that moment would die of it. A worker cannot be checkpointed anyway, so the
time limit is met by its SIGTERM; a preemption that requeues the job comes as SIGTERM too.

A requeued job starts again from the top, in the same output folder: `record_run` noted the run it
started there, so it resumes that run (follows its worker, or starts the worker again in the same run,
its event log continued) instead of creating a second one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from types import FrameType

from orchestrator.config.handover import write_whole

# Our own stop of the worker must fit in Slurm's KillWait (30 s by default, often less): SIGTERM, then SIGKILL.
STOP_GRACE_S = 5.0
_SCONTROL_TIMEOUT_S = 10.0


class SlurmEnd(str, Enum):
    CANCELLED = "cancelled"
    TIME_LIMIT = "time_limit"
    REQUEUED = "requeued"


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job this process runs in, as its environment names it."""

    job_id: str  # `123`, or `123_4` for the 5th task of array 123 (as squeue and scancel take it)
    restarts: int  # how many times Slurm had requeued it when this run of it began

    def describe(self) -> str:
        return f"Slurm job {self.job_id}"


def current_slurm_job() -> SlurmJob | None:
    """The Slurm job of this process, or None outside one."""
    raw = os.environ.get("SLURM_JOB_ID")
    if not raw:
        return None
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array}_{task}" if array and task else raw
    return SlurmJob(job_id, int(os.environ.get("SLURM_RESTART_COUNT") or 0))


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol -o show job`'s fields (JobState, Reason, Restarts, RunTime, TimeLimit, …); {} if it fails."""
    try:
        done = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for word in done.stdout.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


# -- which run a Slurm job follows: said by the job itself, checked before anyone cancels it -------------------

RUN_COMMENT = "ddtree-run:"  # the job's Slurm comment, before the run id (`mark_job`)
JOB_ID = re.compile(r"[0-9]{1,12}(?:_[0-9]{1,9})?")


def mark_job(job: SlurmJob, run_id: str) -> str | None:
    """Put the run id into the job's Slurm comment (`ddtree-run:<run id>`), where `cancel=` looks for it before
    it cancels the job; the run exists only once the job has started, so the job says it itself. Returns
    why it could not (Slurm refused), or None."""
    argv = ["scontrol", "update", f"JobId={job.job_id}", f"Comment={RUN_COMMENT}{run_id}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit code {done.returncode}")


def slurm_job_problem(job_id: str, run_id: str) -> str | None:
    """Why the Slurm job a run's `slurm.job_id` tag names must not be cancelled for it; None when Slurm shows
    it is a job of this user's whose comment (or name) carries the run id. The tag is a claim: an id that is
    not a job id (`--user=x` would cancel every job of the user), someone else's job, or a job of another
    run is refused."""
    if not JOB_ID.fullmatch(job_id or ""):
        return f"the run's slurm.job_id tag {job_id[:40]!r} is not a Slurm job id"
    fields = job_fields(job_id)
    if not fields:
        return f"Slurm knows no job {job_id} (scontrol show job said nothing)"
    owner = re.search(r"\((\d+)\)", fields.get("UserId", ""))
    if owner is None or int(owner[1]) != os.getuid():
        return f"Slurm job {job_id} belongs to {fields.get('UserId', 'nobody known')}, not to you (uid {os.getuid()})"
    if run_id not in fields.get("Comment", "") and run_id not in fields.get("JobName", ""):
        return f"Slurm job {job_id} does not carry run {run_id[:8]} in its comment or name: not this run's job"
    return None


_PASSING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")  # states a job leaves on its own


def settled_state(job_id: str, timeout_s: float = 15.0) -> str:
    """The job's state once Slurm has settled it (`CANCELLED`, `COMPLETED`, …; a job ending goes through
    `COMPLETING` first), or its state after `timeout_s`; `no answer` when scontrol says nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = job_fields(job_id).get("JobState", "no answer")
        if state not in _PASSING or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def seconds(duration: str) -> float | None:
    """Slurm's `[days-]hours:minutes:seconds` (or `minutes:seconds`) in seconds; None for UNLIMITED and the like."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", duration.strip())
    if match is None:
        return None
    days, hours, minutes, secs = (int(part or 0) for part in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def why_stopped(job: SlurmJob, fields: dict[str, str] | None = None) -> SlurmEnd:
    """What Slurm's SIGTERM means for this job, from what `scontrol` says now (see the module's table)."""
    fields = job_fields(job.job_id) if fields is None else fields
    if int(fields.get("Restarts") or job.restarts) > job.restarts:
        return SlurmEnd.REQUEUED
    run, limit = seconds(fields.get("RunTime", "")), seconds(fields.get("TimeLimit", ""))
    past_limit = fields.get("Reason") == "TimeLimit" or (run is not None and limit is not None and run >= limit)
    return SlurmEnd.TIME_LIMIT if past_limit else SlurmEnd.CANCELLED


def time_limit_text(fields: dict[str, str]) -> str:
    limit = fields.get("TimeLimit")
    return f" of {limit}" if limit and seconds(limit) is not None else ""


class SlurmStopped(BaseException):
    """Slurm is stopping the job. A BaseException, as KeyboardInterrupt: no `except Exception` may swallow it."""

    def __init__(self, job: SlurmJob, signum: int) -> None:
        super().__init__(f"{job.describe()} got {signal.Signals(signum).name}")
        self.job = job
        self.signum = signum


class SlurmSignals:
    """For a job's whole life under Slurm: SIGTERM means Slurm is stopping the job, and SIGUSR2 is ignored.

    Before `arm()` (the job has no worker yet) a stop is only remembered, and `check()` raises it at the
    lifecycle's first look; once armed it raises `SlurmStopped` where it lands (once; later ones are noted
    only). Outside Slurm it does nothing."""

    def __init__(self, job: SlurmJob | None) -> None:
        self.job = job
        self.signum: int | None = None
        self.armed = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SlurmSignals:
        if self.job is not None:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._stop)
            # Ignored, not handled: an ignored signal stays ignored in every process this one starts, the
            # worker included, which Slurm's USR2 would otherwise kill (see the module's docstring).
            self._previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return self

    def __exit__(self, *_exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        """The job is stopping its worker already (Ctrl-C, a cancelled sweep): a stop by Slurm now must not
        break off that clean-up; it is only remembered."""
        self.armed = False

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None and self.job is not None:
            self.signum = signum
            # From now on SIGTERM is ignored here and in every command the job runs to stop the worker
            # (`scontrol`, `kill`): Slurm goes on signalling each process of the step, new ones included.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if self.armed:
                raise SlurmStopped(self.job, signum)

    def check(self) -> None:
        if self.signum is not None and self.job is not None:
            raise SlurmStopped(self.job, self.signum)


# -- a requeued job finds the run it started ---------------------------------------------------------------

RUN_RECORD = "slurm_run.json"  # in the job's own output folder (`<sweep dir>/<job number>/`), on shared storage


@dataclass(frozen=True)
class StartedRun:
    run_id: str
    experiment_id: str


def record_run(folder: Path, job: SlurmJob, run: StartedRun) -> None:
    """Note the run this Slurm job started, for the same job after a requeue (written before the worker starts)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_whole(folder / RUN_RECORD, json.dumps({"slurm_job_id": job.job_id, **asdict(run)}) + "\n")


def recorded_run(folder: Path, job: SlurmJob) -> StartedRun | None:
    """The run this same Slurm job started before it was requeued; None for its first start (or another job's
    folder: a sweep folder used again)."""
    try:
        record = json.loads((folder / RUN_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("slurm_job_id") != job.job_id:
        return None
    return StartedRun(str(record["run_id"]), str(record["experiment_id"]))
