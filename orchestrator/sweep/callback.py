"""The Hydra callback of a multirun: the parent run before the jobs, Ctrl-C for all of them, the summary after.

Hydra instantiates callbacks for every run, so MLflow is imported only when a multirun uses it.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from orchestrator.config.redaction import overrides_tag
from orchestrator.sweep.job_errors import runless_jobs
from orchestrator.sweep.membership import CANCELLED_FILE, Sweep, read_sweep_record, write_sweep_record
from orchestrator.tracking import tags
from orchestrator.tracking.status import RunStatus
from remote_worker.wording import counted

# The exit code of the last multirun in this process, for `python -m orchestrator -m ...` to return.
last_exit_code: int | None = None


class SweepCallback(Callback):
    """Creates the parent run before the jobs and writes the summary into it after them.

    Hydra instantiates callbacks for every run, so MLflow is imported only when a multirun uses it."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.sweep.plan import make_plan
        from orchestrator.sweep.precheck import pool_problems, prompt_problems
        from orchestrator.tracking.runs import ensure_experiment, run_url

        hydra_cfg = config.hydra  # HydraConfig is not set yet when a multirun starts
        jobs, swept, job_overrides = _grid(config)
        dry_run = bool(config.sweep.get("dry_run", False))
        if job_overrides:  # every job's prompts before the first job: a missing set is found now, not at its turn
            what = "config" if dry_run else "prompts"
            Console().print(f"checking the {what} of {counted(len(job_overrides), 'job')}", markup=False)
            problems = prompt_problems(config, job_overrides, every_mistake=dry_run)
            if dry_run and not problems and config.sweep.get("hosts"):  # a job's own mistake would repeat per host
                problems += pool_problems(config, job_overrides[0], [str(n) for n in config.sweep.hosts])
            for problem in problems:
                print(problem.line(), file=sys.stderr)
            if problems:
                raise SystemExit(2)  # nothing has started: no parent run, no job
        grid = [_as_settings(job) for job in job_overrides]
        plan = make_plan(OmegaConf.to_container(config, resolve=False), grid) if grid else None
        if dry_run:
            _end_dry_run(plan, jobs)
        client = _client(config)
        experiment_id = ensure_experiment(client, str(config.experiment.name), config.tracking.get("artifact_root"))
        run = client.create_run(
            experiment_id,
            run_name=sweep_name(swept, jobs),
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
        record = {
            "parent_run_id": run.info.run_id,
            "experiment_id": experiment_id,
            "started": time.time(),
            "jobs": jobs,
            "swept": swept,
            "records": plan.records if plan is not None else None,
            "grid": grid,  # each job's settings by number: a job that never made a run is still placed
        }
        write_sweep_record(folder, record)
        count = counted(jobs, "job") if jobs else "jobs"
        Console().print(f"[bold]sweep[/bold] {run.info.run_id} · {count}, each a child run · {folder}")
        if plan is not None:
            Console().print(plan.line(), markup=False, highlight=False)
        Console().print(
            f"sweep run: {run_url(client, experiment_id, run.info.run_id)}",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
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
        from orchestrator.config.redaction import redact_hydra_outputs
        from orchestrator.sweep.summary import summarize_sweep

        global last_exit_code
        signal.signal(signal.SIGINT, self._previous_handler)
        folder = Path(str(config.hydra.sweep.dir)).absolute()
        redact_hydra_outputs(folder)
        record = read_sweep_record(folder)
        assert record is not None, "on_multirun_start wrote it"
        status = summarize_sweep(
            _client(config),
            record["experiment_id"],
            record["parent_run_id"],
            Console(),
            runless_jobs(folder, record["started"] - 1.0),  # 1 s for file systems with coarse times
            list(record.get("swept") or []),
            record.get("grid"),
            _key(config),
        )
        last_exit_code = RunStatus(status).exit_code


def _end_dry_run(plan: Any, jobs: int | None) -> None:
    """A dry run ends after the checks and the plan: no tracking store is opened, no run made, no job started."""
    if plan is not None:
        Console().print(plan.line(), markup=False, highlight=False)
    count = counted(jobs, "job") if jobs else "the jobs (their count is the sweeper's own)"
    Console().print(f"dry run: {count} checked; nothing started (drop sweep.dry_run to run them)", markup=False)
    raise SystemExit(0)


def sweep_name(swept: list[str], jobs: int | None) -> str:
    """`sweep of block_size × temperature · 8 jobs · 12-04 13:05`: what it varies first, as a job's name."""
    what = " × ".join(key.rsplit(".", 1)[-1] for key in swept) or "the defaults"
    count = f" · {counted(jobs, 'job')}" if jobs else ""
    return f"sweep of {what}{count} · {time.strftime('%m-%d %H:%M')}"


def _as_settings(overrides: list[str]) -> dict[str, str]:
    """A job's overrides as key → value (`+` and `~` prefixes dropped), a quoted value unquoted as Hydra reads it
    (`experiment.datasets_dir='/home/me/hf-datasets'`, which is how a typed `~/hf-datasets` reaches Hydra)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    settings = {}
    for override in overrides:
        key, _, text = override.lstrip("+~").partition("=")
        try:
            value = parser.parse_override(override).value()
        except Exception:  # noqa: BLE001 - the job itself reports an override Hydra cannot read
            value = None
        settings[key] = value if isinstance(value, str) else text
    return settings


def _grid(config: DictConfig) -> tuple[int | None, list[str], list[list[str]]]:
    """How many jobs the basic sweeper will launch (its grid times the command line's sweeps; None for any
    other sweeper, whose count is its own business), the keys the sweep varies (for the jobs' names), and each
    job's overrides in launch order, as the launcher gets them (empty where the count is unknown)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra_cfg = config.hydra
    params = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.get("params") or {}).items()]
    try:
        overrides = OverridesParser.create().parse_overrides([*params, *hydra_cfg.overrides.task])
    except Exception:  # noqa: BLE001 - a nicety; the sweep itself reports a bad override
        return None, [], []
    # The command line's value replaces the grid's (as in the basic sweeper): `model=x` ends a `model` axis.
    last = {o.get_key_element(): o.is_sweep_override() for o in overrides}
    swept = [key for key, sweeps in last.items() if sweeps]
    if str(hydra_cfg.runtime.choices.get("hydra/sweeper", "basic")) != "basic":
        return None, swept, []
    try:
        batches = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # noqa: BLE001 - as above
        return None, swept, []
    jobs = [[str(o) for o in job] for batch in batches for job in batch]
    return len(jobs), swept, jobs


def _key(config: DictConfig) -> bytes | None:
    """The user's signing key, to check the runs the sweep reused; None (they are refused) where it cannot be read."""
    from orchestrator.tracking.signing import KeyUnavailable, signing_key

    try:
        return signing_key(Path(str(config.orchestrator.state_dir)))
    except KeyUnavailable as exc:
        print(f"reused runs not checked: {exc}", file=sys.stderr)
        return None


def _client(config: DictConfig) -> Any:
    """The sweep's tracking store, with the same request deadline as its jobs; one line and exit 1 without it."""
    from orchestrator.config.settings import TrackingConfig
    from orchestrator.tracking.client import TrackingUnavailable, open_tracking

    tracking = OmegaConf.to_container(config.tracking, resolve=True)
    assert isinstance(tracking, dict)
    try:
        return open_tracking(TrackingConfig.from_mapping(tracking))
    except TrackingUnavailable as exc:
        print(f"tracking: {exc}", file=sys.stderr)
        raise SystemExit(1) from None  # Hydra would print a traceback for any Exception
