"""Jobs that fail before they have an MLflow run (a config error) still reach the sweep's summary.

Such a job writes its error line into its own output folder, `<sweep dir>/<job number>/error.txt`; the
summary lists every job folder Hydra made for this sweep, with that line where there is one.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

JOB_ERROR_FILE = "error.txt"


def record_job_error(error: str) -> None:
    """A job of a multirun that fails before it has an MLflow run leaves its error where the summary finds it."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        folder = Path(str(hydra_cfg.runtime.output_dir))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / JOB_ERROR_FILE).write_text(error + "\n", encoding="utf-8")


def runless_jobs(folder: Path, started: float) -> dict[int, str]:
    """Every job folder Hydra made for this sweep, with the error its job recorded before it had a run.

    Folders and errors older than the sweep belong to an earlier sweep that used the same folder."""
    jobs = {}
    for job_dir in folder.iterdir():
        written = job_dir / ".hydra" / "overrides.yaml"  # Hydra writes it when the job starts
        if job_dir.name.isdigit() and written.is_file() and written.stat().st_mtime >= started:
            error = job_dir / JOB_ERROR_FILE
            fresh = error.exists() and error.stat().st_mtime >= started
            jobs[int(job_dir.name)] = error.read_text(encoding="utf-8").strip() if fresh else ""
    return jobs
