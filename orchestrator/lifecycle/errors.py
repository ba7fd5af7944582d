"""The ways a phase of the lifecycle can go wrong, each with one meaning for the run (see `job.py`).

| raised              | by                                   | the run                                                |
| ------------------- | ------------------------------------ | ------------------------------------------------------ |
| PhaseFailed         | connect, preflight, sync, launch     | FAILED at that stage; a started worker is stopped      |
| Interrupted         | Ctrl-C, `cancel`                     | the worker is stopped; KILLED unless it had ended      |
| SweepCancelled      | a cancelled sweep (`sweep/`)         | as Interrupted                                         |
| HostLost            | follow, past host.reconnect_budget_s | stays RUNNING for `attach` (the worker goes on)        |
| TrackingUnavailable | any call to MLflow                   | waited out while the worker runs, then left for attach |
| LocalFailure        | the state folder, the local disk     | the worker is stopped; FAILED at stage `local`         |

Anything else is a bug of the orchestrator, treated as a LocalFailure: named, never "host unreachable",
never an orphaned worker. `lifecycle()` in `job.py` gives each its meaning. Some are raised below the
lifecycle and so defined in the lowest layer that raises them (imports run one way, outer to inner):
Interrupted in `host/transport.py` (`host/local.py` raises it for a command the terminal's Ctrl-C killed),
TrackingUnavailable in `tracking/client.py`, LocalFailure in `stream/state.py`, SweepCancelled in
`sweep/membership.py`.
"""

from __future__ import annotations

from orchestrator.host.transport import Interrupted
from orchestrator.stream.state import LocalFailure
from orchestrator.tracking.client import TrackingUnavailable
from orchestrator.tracking.status import Stage

__all__ = ["HostLost", "Interrupted", "LocalFailure", "PhaseFailed", "TrackingUnavailable"]


class PhaseFailed(Exception):
    """A phase could not do its job; `message` is the one line the user sees and the `error` tag."""

    def __init__(self, stage: Stage, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


class HostLost(Exception):
    """The host stayed out of reach for the whole reconnect budget."""
