"""The Slurm launcher's Hydra face; what it does is in `orchestrator/sweep/slurm_launcher.py`.

`hydra/launcher=submitit_slurm` keeps its name and every setting of the submitit plugin, with our launcher
as its `_target_`. Hydra's plugin scan runs each plugin module again (the submitit plugin's config module
included, which stores its own `submitit_slurm`), so ours is stored by a search-path plugin: Hydra calls
those after the scan and before it composes the config.

No `from __future__ import annotations` here: Hydra runs this module before it is in sys.modules, where
a dataclass cannot resolve string annotations.
"""

from dataclasses import dataclass

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

from orchestrator.sweep.slurm_launcher import SweepSlurmLauncher


class SlurmLauncher(SweepSlurmLauncher):
    """Defined here, under `hydra_plugins`, because Hydra instantiates no launcher from anywhere else."""


@dataclass
class SlurmLauncherConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.ddtree_orchestrator.slurm_launcher.SlurmLauncher"


class SlurmLauncherConfig(SearchPathPlugin):
    """Adds no search path: stores `hydra/launcher=submitit_slurm` once every plugin module has run."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        ConfigStore.instance().store(
            group="hydra/launcher", name="submitit_slurm", node=SlurmLauncherConf, provider="orchestrator"
        )
