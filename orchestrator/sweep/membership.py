"""A job's place in its multirun: the sweep folder every job shares, and the cancellation it may carry.

The parent run's id is in `<sweep dir>/sweep.json`, written by the callback before any job starts, so every
job finds it wherever the launcher runs it (this process, a joblib worker, a submitit process, a Slurm node
sharing the folder). A job that ends the sweep early writes `<sweep dir>/cancelled` with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from orchestrator.config.handover import read_whole, write_first, write_whole

SWEEP_FILE = "sweep.json"
CANCELLED_FILE = "cancelled"
REUSED_NOTE = "reused"  # `reused.<parent run>.<job>`: the run a job of the sweep took (`Sweep.note_reused`)


class SweepCancelled(Exception):
    """Another job of the sweep failed under fail_fast, or the sweep was interrupted."""


@dataclass(frozen=True)
class Sweep:
    """The multirun a job belongs to, as the job sees it."""

    dir: Path
    parent_run_id: str
    job_num: int
    fail_fast: bool
    jobs: int | None = None  # how many the sweep launches, when its sweeper says (the basic one does)
    swept: tuple[str, ...] = ()  # the keys the sweep varies

    def cancelled(self) -> str | None:
        """Why the sweep was cancelled, or None."""
        return cancel_reason(self.dir)

    def cancel(self, reason: str) -> None:
        """Stop the rest of the sweep; the first reason given is kept. The mark appears whole, reason and
        all (`write_first`): created empty and filled after, a job polling between the two read a cancel
        with no reason."""
        write_first(self.dir / CANCELLED_FILE, reason + "\n")

    def note_reused(self, run_id: str) -> None:
        """Record in the sweep's own folder that this job took `run_id` (`sweep.resume`, the run checked): the
        progress line each job prints counts reused jobs from these notes, not from the parent's
        `sweep.reused.<job>` tags, which anyone who can write to the tracking store may add."""
        write_whole(self.dir / f"{REUSED_NOTE}.{self.parent_run_id}.{self.job_num}", run_id + "\n", 0o600)

    def reused_here(self) -> dict[int, str]:
        """The jobs of this sweep that took an earlier run, as they noted it: job → run id."""
        found = {}
        for note in self.dir.glob(f"{REUSED_NOTE}.{self.parent_run_id}.*"):
            number = note.name.rsplit(".", 1)[1]
            if number.isdigit() and (text := read_whole(note)) is not None:
                found[int(number)] = text.strip()
        return found

    def check(self) -> None:
        """Raise SweepCancelled when the sweep was cancelled (called between polls of a running job)."""
        reason = self.cancelled()
        if reason is not None:
            raise SweepCancelled(reason)


def cancel_reason(folder: Path) -> str | None:
    """Why the sweep in `folder` was cancelled, or None (also read by a launcher, which has no `Sweep`)."""
    text = read_whole(folder / CANCELLED_FILE)
    return None if text is None else text.strip()


def write_sweep_record(folder: Path, record: dict[str, Any]) -> None:
    """`sweep.json`: the parent run and the grid, for every job (written whole: a Slurm job may start at once)."""
    write_whole(folder / SWEEP_FILE, json.dumps(record) + "\n")


def read_sweep_record(folder: Path) -> dict[str, Any] | None:
    """The sweep's record, or None when it is not written yet."""
    text = read_whole(folder / SWEEP_FILE)
    return None if text is None else json.loads(text)


def sweep_dir_of(hydra_cfg: Any) -> Path:
    folder = Path(str(hydra_cfg.sweep.dir))
    return folder if folder.is_absolute() else Path(str(hydra_cfg.runtime.cwd)) / folder


def current_sweep(fail_fast: bool) -> Sweep | None:
    """The sweep of the running Hydra job, or None outside a multirun."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    folder = sweep_dir_of(hydra_cfg)
    record = read_sweep_record(folder)
    if record is None:
        raise FileNotFoundError(f"{folder / SWEEP_FILE}: the sweep's record is missing")
    swept = tuple(record.get("swept") or ())
    return Sweep(folder, record["parent_run_id"], int(hydra_cfg.job.num), fail_fast, record.get("jobs"), swept)
