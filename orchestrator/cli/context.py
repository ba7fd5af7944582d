"""What a command takes from outside its config: the tracking store, the sweep it belongs to, Hydra's record
of the command line, git, this user's state folder. The commands call these through this module (so a test
can stand each in for one), and nothing else reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from orchestrator.config.redaction import redact_hydra_outputs
from orchestrator.config.settings import JobConfig
from orchestrator.host.transport import Transport
from orchestrator.stream.state import StateStore
from orchestrator.sweep import Sweep, current_sweep
from orchestrator.tracking.client import open_tracking
from orchestrator.tracking.gitinfo import git_info

TransportFactory = Callable[[JobConfig], Transport]


def open_state(config: JobConfig) -> StateStore:
    store = StateStore(Path(config.orchestrator.state_dir))
    store.check()
    return store


def job_folder() -> Path:
    """This job's own output folder (`<sweep dir>/<job number>/` in a multirun)."""
    return Path(str(HydraConfig.get().runtime.output_dir))


def task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task)


def swept_values(sweep: Sweep) -> dict[str, str]:
    """This sweep job's values of the keys the sweep varies (its grid and the command line's), for its name."""
    hydra_cfg = HydraConfig.get()
    swept = set(sweep.swept) or set((hydra_cfg.sweeper.get("params") or {}).keys())
    values = {}
    for override in hydra_cfg.overrides.task:
        key, _, value = str(override).lstrip("+~").partition("=")
        if key in swept:
            values[key] = value
    return values


def keep_hydra_files_secret() -> None:
    """Hydra has written the job's config and overrides into its output folder: redact them there."""
    hydra_cfg = HydraConfig.get()
    redact_hydra_outputs(Path(str(hydra_cfg.runtime.output_dir)))
    if hydra_cfg.mode == RunMode.MULTIRUN:
        folder = Path(str(hydra_cfg.sweep.dir))
        redact_hydra_outputs(folder if folder.is_absolute() else Path(str(hydra_cfg.runtime.cwd)) / folder)


__all__ = [  # the seams a test stands in for (the first three: imported here, called as `context.<name>`)
    "TransportFactory",
    "current_sweep",
    "git_info",
    "job_folder",
    "keep_hydra_files_secret",
    "open_state",
    "open_tracking",
    "swept_values",
    "task_overrides",
]
