"""Every MLflow tag name the orchestrator writes or reads, in one place (as MLflow's own `mlflow_tags.py`).

A tag name is a public contract: the UI filters on it, `attach` reads it back, the sweep summary groups by
it. Changing one here changes it everywhere; nothing else spells a tag name out.
"""

from __future__ import annotations

# MLflow's own tags.
PARENT_RUN_ID = "mlflow.parentRunId"
EXPERIMENT_KIND = "mlflow.experimentKind"  # an experiment's: which of its views MLflow 3's UI opens
CLASSIC_EXPERIMENT = "custom_model_development"  # runs, metrics, charts (not GenAI's traces and evaluations)
SOURCE_GIT_COMMIT = "mlflow.source.git.commit"

# What the run is, and where it lives (`tracking/location.py`): attach, cancel and logs read these back.
HOST = "host"
HOST_WORKDIR = "host.workdir"
HOST_HOSTNAME = "host.hostname"
HOST_PORT = "host.port"
HOST_USER = "host.user"
HOST_GATEWAY = "host.gateway"  # ProxyJump
HOST_RUN_DIR = "host.run_dir"  # set when the run's folder is written on the host (the launch)
MODEL = "model"
GIT_COMMIT = "git.commit"
GIT_DIRTY = "git.dirty"
HYDRA_OVERRIDES = "hydra.overrides"
LAUNCH_USER = "launch.user"  # who launched the run, and from which machine: for readers, never believed by the tool
LAUNCH_MACHINE = "launch.machine"

# How it ended, when it did not finish.
ERROR = "error"
FAILURE_STAGE = "failure_stage"

# The worker, as it reported itself (start and end events).
WORKER_PID = "worker.pid"
WORKER_GPU = "worker.gpu"
WORKER_STATUS = "worker.status"
MISSING_ARTIFACT_PREFIX = "missing_artifact."
EVENT_LOG_WARNINGS = "event_log.warnings"

# What the job's page shows: where the worker is, the summary table, the best drafting method.
PROGRESS = "progress"
NOTE = "mlflow.note.content"  # the run's description in the MLflow UI (Markdown)
BEST_METHOD = "best.method"
BEST_TREE_BUDGET = "best.tree_budget"
BEST_BASIS = "best.basis"  # how sure the best is: its interval clears the runner-up's, or why none is named

# The orchestrator's own bookkeeping: where the stream stands, who follows the run.
SCOPE = "orchestrator.scope"
LAST_SEQ = "orchestrator.last_seq"
OFFSET = "orchestrator.offset"
DETACHED = "orchestrator.detached"
ATTACH_COMMAND = "attach_command"

# Sweeps: the parent run and the place of each job in it.
ROLE = "orchestrator.role"
SWEEP_JOB = "sweep.job"
SWEEP_LAUNCHER = "sweep.launcher"
SWEEP_FAIL_FAST = "sweep.fail_fast"
SWEEP_JOBS = "sweep.jobs"
SWEEP_NOT_FINISHED = "sweep.not_finished"
SWEEP_BEST_JOB = "sweep.best_job"
# A sweep run again (`sweep/resume.py`): each job run's settings digest, and on a sweep's parent the jobs it
# took from earlier runs with the same settings (`sweep.reused.<job>` = that run's id).
CONFIG_HASH = "orchestrator.config_hash"
SIGNATURE = "orchestrator.signature"  # HMAC of a FINISHED job run by its user's key (tracking/signing.py)
SWEEP_REUSED_PREFIX = "sweep.reused."
# A two-phase job's phase 1 (`phase_1.json`), signed as the orchestrator receives it (tracking/signing.py), and
# on a job's run that went on from an earlier run's phase 1, that run's id.
PHASE_1_SIGNATURE = "orchestrator.phase_1_signature"
PHASE_1_FROM = "orchestrator.phase_1_from"

# A sweep job Slurm ran (`sweep/slurm.py`): its job id (`123_4` for an array's task), how often it was requeued.
SLURM_JOB_ID = "slurm.job_id"
SLURM_REQUEUED = "slurm.requeued"
