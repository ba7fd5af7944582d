"""Local side: the Hydra app that launches the remote worker, follows its event log and records it in MLflow.

Never imports torch: the heavy lifting happens in `remote_worker`, on the host the config names. The packages
are layers, each importing only those below it (tests/test_architecture.py holds them to it):

    cli        the entry point and the commands (run, detach, attach, cancel, list, logs)
    lifecycle  one run's phases, what each failure means, Ctrl-C, the live terminal view
    sweep      Hydra multiruns: the parent run, a job's membership and host, the sweep's summary, the paper's table
    stream     the worker's events: parsed, mirrored locally, applied to MLflow exactly once
    tracking   MLflow: the client, a job's run, tags, statuses, the job's summary and plots
    host       where the worker runs: the Transport interface, local and SSH, sync, preflight, launch
    config     the typed settings, their validation, redaction, prompt sets, the checkout's paths
"""

from omegaconf import OmegaConf

from orchestrator.config.paths import CONF_DIR, PROJECT_ROOT

__all__ = ["CONF_DIR", "PROJECT_ROOT"]

# `${project_root:}` in the config tree: paths that mean "inside this checkout" wherever Hydra was started.
OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
