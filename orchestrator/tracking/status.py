"""How a job ends, in one place: the statuses, the stages a failure is charged to, and their exit codes.

| status     | MLflow run status | exit code | meaning                                                                 |
| ---------- | ----------------- | --------- | ----------------------------------------------------------------------- |
| FINISHED   | FINISHED          | 0         | the worker recorded `end` FINISHED and everything was applied           |
| FAILED     | FAILED            | 1         | the worker recorded FAILED, or died, or a phase before it failed, or    |
|            |                   |           | Slurm's time limit stopped it                                           |
| KILLED     | KILLED            | 130       | Ctrl-C, a cancelled sweep, `scancel`, or the worker's SIGTERM           |
|            |                   | 143       | `cancel=` from another command, for the orchestrator following the run  |
| DETACHED   | stays RUNNING     | 75        | left for `attach` (host or MLflow out of reach), or for the requeued    |
|            |                   |           | Slurm job that resumes it                                               |

`detach=true` also leaves the run RUNNING, as asked: exit 0. `cancel` exits 0 once the run has ended.
A config mistake exits 2 before any run exists (see `CONFIG_ERROR_EXIT`); a run that cannot even begin
(tracking server or state folder unusable) exits 1 with one line and creates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

CONFIG_ERROR_EXIT = 2
CANCELLED_ELSEWHERE_EXIT = 143  # 128 + SIGTERM: stopped on request from elsewhere, not by this terminal's Ctrl-C
NOT_STARTED = "not started: "  # how the error of a sweep's job cancelled before it began starts


class RunStatus(str, Enum):
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"
    DETACHED = "DETACHED"

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self]

    @property
    def ends_the_run(self) -> bool:
        """DETACHED leaves the MLflow run RUNNING, for `attach` to finish."""
        return self is not RunStatus.DETACHED

    @classmethod
    def from_worker(cls, value: object) -> RunStatus:
        """The status a worker's `end` event names; anything unknown counts as FAILED."""
        try:
            status = cls(str(value))
        except ValueError:
            return cls.FAILED
        return cls.FAILED if status is cls.DETACHED else status


_EXIT_CODES = {RunStatus.FINISHED: 0, RunStatus.FAILED: 1, RunStatus.KILLED: 130, RunStatus.DETACHED: 75}

# The colour a terminal shows an MLflow run status in (a run's summary, a sweep's table).
STATUS_STYLE = {"FINISHED": "green", "FAILED": "red", "KILLED": "yellow"}


class Stage(str, Enum):
    """The phase a failure belongs to (the `failure_stage` tag)."""

    CONNECT = "connect"
    PREFLIGHT = "preflight"
    SYNC = "sync"
    LAUNCH = "launch"
    FOLLOW = "follow"
    WORKER = "worker"
    COLLECT = "collect"
    CANCEL = "cancel"
    SWEEP = "sweep"
    SLURM = "slurm"  # Slurm stopped the job: scancel, its time limit
    LOCAL = "local"  # this machine: the state folder, the local disk, a bug in the orchestrator


@dataclass(frozen=True)
class Outcome:
    """How the job ended (or why it was left running), with the one line that says why."""

    status: RunStatus
    error: str | None = None
    stage: Stage | None = None
    exit_code: int | None = None  # where the status's own code would say something else (see the table)

    @property
    def code(self) -> int:
        """The process's exit code for this ending."""
        return self.status.exit_code if self.exit_code is None else self.exit_code
