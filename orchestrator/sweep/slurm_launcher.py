"""`hydra/launcher=submitit_slurm`, answering for every job it submits.

The plugin's launcher submits the grid as one Slurm array and waits on each job's result file. It asks
`sacct` how a job without one is doing, which a cluster without accounting storage cannot answer (it
waits forever), and a job cancelled before it ran never writes one. This launcher submits the same way and
waits its own way:

- a job is done when its result file is there, or when Slurm no longer lists it (`squeue`); a job that
  left no result is a row of the sweep's summary with what Slurm says of it, never a silent gap;
- when the sweep is cancelled (Ctrl-C in this process writes `<sweep dir>/cancelled`, see `callback.py`),
  it cancels every job still queued or running (`scancel`): running ones stop their workers and end their
  runs KILLED with the sweep's reason (`slurm.py`), pending ones end as `not started`;
- the jobs' ids are in `<sweep dir>/slurm_jobs.json` (job number → Slurm job id), and each job's run
  carries its own as the `slurm.job_id` tag.

`conf/hydra/launcher/submitit_slurm.yaml` puts it under the plugin's own name, so
`hydra/launcher=submitit_slurm` and every `hydra.launcher.*` setting of the plugin work unchanged.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as PluginSlurmLauncher
from omegaconf import OmegaConf

from orchestrator.config.handover import write_whole
from orchestrator.sweep.job_errors import record_runless
from orchestrator.sweep.membership import cancel_reason
from orchestrator.sweep.slurm import job_fields
from orchestrator.tracking.status import NOT_STARTED, RunStatus
from remote_worker.wording import counted

log = logging.getLogger(__name__)

JOBS_FILE = "slurm_jobs.json"
POLL_S = 1.0
QUEUE_EVERY_S = 5.0  # squeue is a request to slurmctld: not every poll
GONE_AFTER = 2  # a job absent from the queue this many looks in a row (its result file may trail by a moment)


class SweepSlurmLauncher(PluginSlurmLauncher):
    """The plugin's launcher with our own submission record and wait (Hydra instantiates the subclass in
    `hydra_plugins/ddtree_orchestrator/`)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None and len(job_overrides) > 0
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **self._init_params())
        executor.update_parameters(**self._job_params())
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*job_params, strict=True))
        numbers = [params[2] for params in job_params]
        ids = {number: job.job_id for number, job in zip(numbers, jobs, strict=True)}
        write_whole(sweep_dir / JOBS_FILE, json.dumps(ids) + "\n")
        array = jobs[0].job_id.split("_")[0]
        print(f"submitted {counted(len(jobs), 'job')} to Slurm as array {array} (squeue -j {array})", flush=True)
        return _wait(sweep_dir, list(zip(numbers, job_overrides, jobs, strict=True)))

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """The job, on its node. SIGUSR2 is ignored from its first moment (see `slurm.py`): submitit's own
        handler would otherwise answer the time limit's warning by raising inside the job."""
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return super().__call__(*args, **kwargs)

    def _init_params(self) -> dict[str, Any]:
        """The executor's own settings, as the plugin gives them."""
        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        return init

    def _job_params(self) -> dict[str, Any]:
        """Every other setting: the shared ones by name, Slurm's with the executor's prefix (as the plugin)."""
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        return {
            (key if key in shared else f"{self._EXECUTOR}_{key}"): value
            for key, value in self.params.items()
            if key not in ("submitit_folder", "max_num_timeout")
        }


def _wait(sweep_dir: Path, jobs: list[tuple[int, Sequence[str], Any]]) -> list[JobReturn]:
    """Each job's return, in order: its result when it wrote one, else what Slurm made of it."""
    results: dict[int, JobReturn] = {}
    absent = dict.fromkeys(range(len(jobs)), 0)
    cancelled_sent = False
    next_queue = 0.0
    while len(results) < len(jobs):
        for index, (number, overrides, job) in enumerate(jobs):
            if index not in results and job.paths.result_pickle.exists():
                results[index] = _result(sweep_dir, number, overrides, job)
        waiting = [index for index in range(len(jobs)) if index not in results]
        reason = cancel_reason(sweep_dir)
        if reason is not None and not cancelled_sent and waiting:
            _scancel([jobs[index][2].job_id for index in waiting])
            cancelled_sent = True
            next_queue = 0.0
        if waiting and time.monotonic() >= next_queue:
            listed = _listed({jobs[index][2].job_id.split("_")[0] for index in waiting})
            for index in waiting:
                number, overrides, job = jobs[index]
                absent[index] = 0 if listed is None or job.job_id in listed else absent[index] + 1
                if absent[index] >= GONE_AFTER and not job.paths.result_pickle.exists():
                    results[index] = _without_result(sweep_dir, number, overrides, job.job_id, reason)
            next_queue = time.monotonic() + QUEUE_EVERY_S
        if len(results) < len(jobs):
            time.sleep(POLL_S)
    return [results[index] for index in range(len(jobs))]


def _result(sweep_dir: Path, number: int, overrides: Sequence[str], job: Any) -> JobReturn:
    """What the job returned; a job that raised (in submitit, before or around the orchestrator's own code,
    which returns an exit code whatever happens) is a FAILED row of the summary, never the sweep's crash."""
    try:
        returned = job.results()[0]
        if returned.status is not JobStatus.FAILED:
            return returned
        raise returned._return_value
    except Exception as exc:  # noqa: BLE001 - any of a job's exceptions is that job's failure
        error = f"Slurm job {job.job_id} failed before it had a run: {type(exc).__name__}: {exc}"
    record_runless(sweep_dir / str(number), error)
    print(f"job #{number}: {error}", flush=True)
    return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=RunStatus.FAILED.exit_code)


def _without_result(
    sweep_dir: Path, number: int, overrides: Sequence[str], job_id: str, cancelled: str | None
) -> JobReturn:
    """A job Slurm no longer lists and that left no result: cancelled while pending, or lost with its node."""
    state = job_fields(job_id).get("JobState")
    if cancelled is not None:
        error, status = f"{NOT_STARTED}{cancelled} (Slurm job {job_id} cancelled)", RunStatus.KILLED
    elif state == "CANCELLED":
        error, status = f"{NOT_STARTED}Slurm job {job_id} was cancelled before it ran", RunStatus.KILLED
    else:
        error = f"Slurm job {job_id} ended without a result ({state or 'Slurm no longer knows it'})"
        status = RunStatus.FAILED
    record_runless(sweep_dir / str(number), error)
    print(f"job #{number}: {error}", flush=True)
    return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=status.exit_code)


def _scancel(job_ids: list[str]) -> None:
    print(f"cancelling {len(job_ids)} Slurm jobs of the sweep: scancel {' '.join(job_ids)}", flush=True)
    subprocess.run(["scancel", *job_ids], capture_output=True, timeout=60)


def _listed(arrays: set[str]) -> set[str] | None:
    """The ids Slurm still lists for these arrays, one per task (`-r`); None when squeue cannot answer."""
    try:
        argv = ["squeue", "-h", "-r", "-o", "%i", "-j", ",".join(sorted(arrays))]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        # An id slurmctld has forgotten (past MinJobAge) is an error when it is the only one asked about.
        return set() if "Invalid job id" in done.stderr else None
    return set(done.stdout.split())
