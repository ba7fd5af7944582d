"""Hydra multiruns as one MLflow parent run with every job a child run under it.

The parent is made by a Hydra callback in the launching process before any job starts; its id goes to
`<sweep dir>/sweep.json`, which every job reads, wherever the launcher runs it (in this process, a joblib
worker, a submitit process or a Slurm node sharing the folder). A job that ends a sweep early (a failure
under `sweep.fail_fast`, or Ctrl-C) writes `<sweep dir>/cancelled`: running jobs stop their workers and
end KILLED, jobs not started yet end KILLED at once. When the multirun returns, the callback writes the
summary (CSV, Markdown, plots) into the parent and ends it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from orchestrator import tags
from orchestrator.redaction import overrides_tag
from orchestrator.status import RunStatus
from orchestrator.validation import ConfigError

SWEEP_FILE = "sweep.json"
CANCELLED_FILE = "cancelled"
JOB_ERROR_FILE = "error.txt"  # in a job's output folder, <sweep dir>/<job number>/
ROLE_TAG = tags.ROLE
JOB_TAG = tags.SWEEP_JOB

# The exit code of the last multirun in this process, for `python -m orchestrator -m ...` to return.
last_exit_code: int | None = None


class SweepCancelled(Exception):
    """Another job of the sweep failed under fail_fast, or the sweep was interrupted."""


@dataclass(frozen=True)
class Sweep:
    """The multirun a job belongs to, as the job sees it."""

    dir: Path
    parent_run_id: str
    job_num: int
    fail_fast: bool

    def cancelled(self) -> str | None:
        """Why the sweep was cancelled, or None."""
        path = self.dir / CANCELLED_FILE
        return path.read_text(encoding="utf-8").strip() if path.exists() else None

    def cancel(self, reason: str) -> None:
        """Stop the rest of the sweep; the first reason given is kept."""
        try:
            fd = os.open(self.dir / CANCELLED_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(reason + "\n")

    def check(self) -> None:
        """Raise SweepCancelled when the sweep was cancelled (called between polls of a running job)."""
        reason = self.cancelled()
        if reason is not None:
            raise SweepCancelled(reason)


def _sweep_dir(hydra_cfg: Any) -> Path:
    folder = Path(str(hydra_cfg.sweep.dir))
    return folder if folder.is_absolute() else Path(str(hydra_cfg.runtime.cwd)) / folder


def assign_host(cfg: DictConfig) -> DictConfig:
    """In a multirun with `sweep.hosts`, job N runs on `sweep.hosts[N % len]`.

    The job's config is composed again with that host, so `host.*` overrides apply to every host of the
    pool; GPU leases then spread the jobs a host receives over its GPUs."""
    pool = [str(name) for name in (cfg.sweep.get("hosts") or [])]
    hydra_cfg = HydraConfig.get()
    if not pool or hydra_cfg.mode != RunMode.MULTIRUN:
        return cfg
    from hydra import compose
    from hydra.errors import MissingConfigException

    name = pool[int(hydra_cfg.job.num) % len(pool)]
    try:
        # The search path of this app (hydra.searchpath) must be given again, or added config folders are unseen.
        searchpath = [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.searchpath=")]
        overrides = [*searchpath, *hydra_cfg.overrides.task, f"host={name}"]
        return compose(config_name=hydra_cfg.job.config_name, overrides=overrides)
    except MissingConfigException as exc:
        raise ConfigError(f"sweep.hosts: no host config named {name!r} (conf/host/{name}.yaml)") from exc


def record_job_error(error: str) -> None:
    """A job of a multirun that fails before it has an MLflow run leaves its error where the summary finds it."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        folder = Path(str(hydra_cfg.runtime.output_dir))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / JOB_ERROR_FILE).write_text(error + "\n", encoding="utf-8")


def current_sweep(fail_fast: bool) -> Sweep | None:
    """The sweep of the running Hydra job, or None outside a multirun."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    folder = _sweep_dir(hydra_cfg)
    record = json.loads((folder / SWEEP_FILE).read_text(encoding="utf-8"))
    return Sweep(folder, record["parent_run_id"], int(hydra_cfg.job.num), fail_fast)


class SweepCallback(Callback):
    """Creates the parent run before the jobs and writes the summary into it after them.

    Hydra instantiates callbacks for every run, so MLflow is imported only when a multirun uses it."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.tracking.runs import ensure_experiment

        client = _client(config)
        experiment_id = ensure_experiment(client, str(config.experiment.name), config.tracking.get("artifact_root"))
        hydra_cfg = config.hydra  # HydraConfig is not set yet when a multirun starts
        run = client.create_run(
            experiment_id,
            run_name=f"sweep-{time.strftime('%m%d-%H%M%S')}",
            tags={
                tags.ROLE: "sweep",
                tags.HYDRA_OVERRIDES: overrides_tag(hydra_cfg.overrides.task),
                tags.SWEEP_LAUNCHER: str(hydra_cfg.runtime.choices.get("hydra/launcher", "basic")),
                tags.SWEEP_FAIL_FAST: str(bool(config.sweep.fail_fast)).lower(),
            },
        )
        folder = Path(str(hydra_cfg.sweep.dir)).absolute()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CANCELLED_FILE).unlink(missing_ok=True)  # a sweep folder given again: forget the last sweep
        record = {"parent_run_id": run.info.run_id, "experiment_id": experiment_id, "started": time.time()}
        (folder / SWEEP_FILE).write_text(json.dumps(record) + "\n", encoding="utf-8")
        Console().print(f"[bold]sweep[/bold] {run.info.run_id} · jobs are its child runs · {folder}")
        self._sweep = Sweep(folder, run.info.run_id, -1, bool(config.sweep.fail_fast))
        self._previous_handler = signal.signal(signal.SIGINT, self._interrupted)

    def _interrupted(self, _signum: int, _frame: FrameType | None) -> None:
        """Ctrl-C in the launching process cancels the sweep instead of abandoning its jobs.

        Running jobs (here, in joblib workers, in submitit processes) then stop their workers and end
        KILLED, jobs not started yet end KILLED at once, and the multirun returns to write the summary."""
        if self._sweep.cancelled() is None:
            self._sweep.cancel("the sweep was interrupted (Ctrl-C)")
            Console().print("[yellow]interrupted: stopping every job of the sweep[/yellow]")
        else:
            Console().print("[yellow]already stopping the sweep's jobs; please wait[/yellow]")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.redaction import redact_hydra_outputs
        from orchestrator.sweep_summary import summarize_sweep

        global last_exit_code
        signal.signal(signal.SIGINT, self._previous_handler)
        folder = Path(str(config.hydra.sweep.dir)).absolute()
        redact_hydra_outputs(folder)
        record = json.loads((folder / SWEEP_FILE).read_text(encoding="utf-8"))
        status = summarize_sweep(
            _client(config),
            record["experiment_id"],
            record["parent_run_id"],
            Console(),
            _runless_jobs(folder, record["started"] - 1.0),  # 1 s for file systems with coarse times
        )
        last_exit_code = RunStatus(status).exit_code


def _runless_jobs(folder: Path, started: float) -> dict[int, str]:
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


def _client(config: DictConfig) -> Any:
    """The sweep's tracking store, with the same request deadline as its jobs."""
    from orchestrator.settings import TrackingConfig
    from orchestrator.tracking.client import open_tracking

    tracking = OmegaConf.to_container(config.tracking, resolve=True)
    assert isinstance(tracking, dict)
    return open_tracking(
        TrackingConfig(
            kind=str(tracking["kind"]),
            uri=str(tracking["uri"]),
            artifact_root=tracking.get("artifact_root"),
            timeout_s=float(tracking["timeout_s"]),
            outage_wait_s=float(tracking["outage_wait_s"]),
        )
    )
