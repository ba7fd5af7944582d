"""Hydra multiruns as one MLflow parent run with every job a child run under it.

- `membership`: the sweep folder a job shares with the others, and the cancellation it may carry
- `host_pool`: `sweep.hosts`, each job on a host of the pool with a free GPU lease
- `job_errors`: jobs that failed before they had a run, for the summary
- `callback`: the parent run before the jobs, Ctrl-C for all of them, the summary after
- `rows`: the jobs' and methods' results, read back from MLflow
- `summary`: the summary itself (table, CSV, Markdown), with `plot`'s figure

A job that ends a sweep early (a failure under `sweep.fail_fast`, or Ctrl-C) writes `<sweep dir>/cancelled`:
running jobs stop their workers and end KILLED, jobs not started yet end KILLED at once.
"""

from orchestrator.sweep.callback import SweepCallback
from orchestrator.sweep.host_pool import assign_host
from orchestrator.sweep.job_errors import record_job_error
from orchestrator.sweep.membership import Sweep, SweepCancelled, current_sweep

__all__ = ["Sweep", "SweepCallback", "SweepCancelled", "assign_host", "current_sweep", "record_job_error"]
