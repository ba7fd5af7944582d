"""The Hydra entry point. Group choices are checked first, so a typo gives one line, not a Hydra report."""

from __future__ import annotations

import logging
import os
import shutil
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from orchestrator.config.home_paths import expand_local_paths
from orchestrator.config.paths import CONF_DIR
from orchestrator.config.validation import ConfigError, check_group_choices


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> int:
    from orchestrator.cli.app import run_job  # imported here: MLflow is slow to import and --help needs none of it

    code = run_job(cfg)
    if HydraConfig.get().mode == RunMode.RUN:
        sys.exit(code)
    return code


def quiet_libraries() -> None:
    """Libraries whose lines we report ourselves: paramiko's errors come back as exceptions; a local store's
    migrations (alembic, MLflow's `Creating initial MLflow database tables...`), urllib3's retries. Set before
    Hydra starts: a sweep's callback opens the store before any job does."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # MLflow sets its level when imported, from this
    # its `Downloading artifacts: 100%|███|` bars, drawn when a finished run's files are read back to sign them
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    for chatty in ("alembic", "matplotlib", "mlflow", "urllib3"):  # matplotlib: `generated new fontManager`
        logging.getLogger(chatty).setLevel(logging.WARNING)


def main() -> None:
    quiet_libraries()
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from orchestrator.cli.help import help_text

        print(help_text(shutil.get_terminal_size().columns))
        return
    sys.argv[1:] = expand_local_paths(sys.argv[1:])  # `~` and `$HOME` in a local path setting, before Hydra
    try:
        check_group_choices(sys.argv[1:], CONF_DIR)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    hydra_main()
    from orchestrator.sweep import callback  # a multirun's status, set once every job has returned

    if callback.last_exit_code is not None:
        sys.exit(callback.last_exit_code)
