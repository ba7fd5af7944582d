"""Jobs that fail before they have an MLflow run (a config error) still reach the sweep's summary.

Such a job writes its error line into its own output folder, `<sweep dir>/<job number>/error.txt`; the
summary lists every job folder Hydra made for this sweep, with that line where there is one. A job that
never ran at all (a Slurm job cancelled while pending) has its line written there by the launcher.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from orchestrator.config.handover import read_whole, write_whole

JOB_ERROR_FILE = "error.txt"


def record_job_error(error: str) -> None:
    """A job of a multirun that fails before it has an MLflow run leaves its error where the summary finds it."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        folder = Path(str(hydra_cfg.runtime.output_dir))
        folder.mkdir(parents=True, exist_ok=True)
        write_whole(folder / JOB_ERROR_FILE, error + "\n")


def record_runless(job_dir: Path, error: str) -> None:
    """A job the launcher knows never had a run (cancelled while queued, crashed in submitit): its `error` for
    the summary."""
    job_dir.mkdir(parents=True, exist_ok=True)
    write_whole(job_dir / JOB_ERROR_FILE, error + "\n")


def runless_jobs(folder: Path, started: float) -> dict[int, str]:
    """Every job folder Hydra (or the launcher, for a job that never ran) made for this sweep, with the error
    its job recorded before it had a run.

    Folders and errors older than the sweep belong to an earlier sweep that used the same folder."""
    jobs = {}
    for job_dir in folder.iterdir():
        if not job_dir.name.isdigit():
            continue
        written = job_dir / ".hydra" / "overrides.yaml"  # Hydra writes it when the job starts
        error = job_dir / JOB_ERROR_FILE
        fresh = error.exists() and error.stat().st_mtime >= started
        if fresh or (written.is_file() and written.stat().st_mtime >= started):
            jobs[int(job_dir.name)] = (read_whole(error) or "").strip() if fresh else ""
    return jobs
