"""The paper's table at a fraction of its grid: measure on a sample, choose, then decode only what the table needs.

Phase 1, on a sample of the records (every k-th, at least MIN_SAMPLE, or all of a smaller set): AR, DFlash and
DDTree at the largest budget, and the round costs of this host (`node_cost`). From them, tau at every budget
(`budget_curve`, from the largest budget's trees), each budget's predicted speed (`budget_choice`) and AR's
step cost against context length (`orchestrator.sweep.paper.ar_prediction`). Phase 2, on every record: DFlash
and DDTree at the budget phase 1 chose. The table's DDTree cell is then one budget chosen before it was
measured, where the paper's is the best of seven measurements (a maximum, which favours luck).

This module holds the two decisions the phases share: which records are the sample, and which budget phase 2
decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: the orchestrator's plan reads `sample_positions`
    from remote_worker.decoding.budget_choice import Prediction

# Phase 1 kept whole at its end (`experiments.phase_one_state`), so that a job stopped in phase 2 resumes there.
PHASE_1_FILE = "phase_1.json"

# `decode.protocol`: every method on every record (the paper's grid), or the two phases of this module.
PROTOCOLS = ("grid", "two_phase")

# The fewest records phase 1 decodes (the whole set when smaller): enough for the bootstrap's intervals and
# for a fit of AR's two-parameter step cost to be checked by leaving records out.
MIN_SAMPLE = 16


def sample_positions(count: int, every: int, minimum: int = MIN_SAMPLE) -> list[int]:
    """The positions (0 … count − 1) of phase 1's records: every `every`-th from the first, or, where that is
    fewer than `minimum`, `minimum` positions spread as evenly; every position of a set of `minimum` or fewer."""
    if count < 0 or every < 1 or minimum < 1:
        raise ValueError(f"count={count} must be >= 0, every={every} and minimum={minimum} >= 1")
    if count <= minimum:
        return list(range(count))
    positions = list(range(0, count, every))
    if len(positions) >= minimum:
        return positions
    return sorted({k * count // minimum for k in range(minimum)})


@dataclass(frozen=True)
class Choice:
    """The budget phase 2 decodes, and why it (the line a run prints)."""

    budget: int
    why: str


def choose_budget(prediction: Prediction | None, largest: int) -> Choice:
    """The budget phase 1's prediction names fastest, among those that fit the device, whenever its costs
    describe the rounds the run decodes. Where one budget cannot be told from others (`Prediction.ranged`), or
    the prediction withholds its answer for a reason of the whole run (no budget faster than AR by its costs;
    every drafting method measured slower than AR), the fastest predicted still: the costs rank the budgets all
    the same, the cell needs one, and the reason goes with it. Phase 1 decodes one budget, the largest, which is
    often slower than AR where a smaller one is not: a rule that fell back to it there chose the slowest budget
    of all (a bench run chose 1024 at ×0.08 beside 37 predicted at ×1.12). Where the costs are of other rounds
    than the run decoded, or there is no prediction, the largest budget, which phase 1 measured."""
    if prediction is None:
        return Choice(largest, "no prediction from phase 1: the budget it decoded")
    if prediction.costs_kind != prediction.run_kind:
        return Choice(largest, f"phase 1's prediction cannot answer, {prediction.cannot_tell}: the budget it decoded")
    if prediction.cannot_tell:
        return Choice(prediction.best_budget, f"the fastest predicted by phase 1, though {prediction.cannot_tell}")
    if prediction.ranged:
        return Choice(
            prediction.best_budget,
            f"the fastest predicted of {len(prediction.within)} budgets phase 1 cannot tell apart: "
            f"{prediction.no_single}",
        )
    return Choice(prediction.best_budget, "predicted fastest by phase 1")
