"""Experiments the worker can run, by the name `experiment.name` gives."""

from __future__ import annotations

from collections.abc import Callable

from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
from remote_worker.experiments.node_cost import run_node_cost
from remote_worker.experiments.probe import run_probe
from remote_worker.spec import Spec

# An experiment reports through the event log and returns a short summary (label → text) for the terminal.
Experiment = Callable[[Spec, EventLog], dict[str, str]]

EXPERIMENTS: dict[str, Experiment] = {"probe": run_probe, "ddtree_gdn": run_ddtree_gdn, "node_cost": run_node_cost}
