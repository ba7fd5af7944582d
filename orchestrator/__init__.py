"""Local side: the Hydra app that launches the remote worker, follows its event log and records it in MLflow.

Never imports torch: the heavy lifting happens in `remote_worker`, on the host the config names.
"""

from pathlib import Path

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = PROJECT_ROOT / "conf"

# `${project_root:}` in the config tree: paths that mean "inside this checkout" wherever Hydra was started.
OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
