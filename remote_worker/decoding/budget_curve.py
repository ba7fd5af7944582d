"""tau at every tree budget b ≤ B from the rounds of one DDTree decode at budget B.

The best-first tree of budget b is the first b nodes of the tree of budget B, in the same order (the prefix
property: `tree_build`'s module doc), and a DDTree round verifies every node of its tree. So for each round
of a budget-B decode, what a round at budget b would have accepted from the same state is known exactly:
the walk restricted to nodes numbered ≤ b. A tree lists parents before children, so the numbers rise along
the accepted path, and that restricted walk is the path's prefix of nodes numbered ≤ b (`accepted_within`;
`walk_within` is the naive reference, tied to it by a test).

Summed over the decode's rounds that gives tau(b) for every b at once. It is an estimate of what a decode at
budget b reports, not that decode: a budget-b decode accepts less per round, so its rounds start at other
positions of the text and meet other drafts. The decode experiment compares the estimate with its real
decodes at the smaller budgets it ran (`compare`), and docs/results.md gives the error measured on the trained
pair.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from remote_worker.decoding.tree_build import DraftTree


def accepted_within(nodes: list[int], budget: int) -> int:
    """Drafted tokens a round accepts under budget `budget`, from its accepted path at a larger budget.
    nodes: the path's node numbers below the root, rising (as `DecodeResult.accepted_nodes` keeps them)."""
    return bisect.bisect_right(nodes, budget)


def walk_within(draft: DraftTree, targets: list[int], budget: int) -> list[int]:
    """The naive reference of `accepted_within`: the accepted path (node numbers from the root) of the walk
    on the tree cut to its first `budget` nodes below the root, given the target's token at every node."""
    path = [0]
    while (child := draft.children[path[-1]].get(targets[path[-1]])) is not None and child <= budget:
        path.append(child)
    return path


@dataclass
class BudgetCurve:
    """One DDTree method's rounds, summed per budget: `tau()[b - 1]` is tau at budget b, for b = 1 … budget."""

    budget: int
    rounds: int = 0
    # at_node[k]: rounds whose accepted path holds node number k (k = 1 … budget; 0 unused)
    at_node: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"a budget curve needs a budget of at least 1, not {self.budget}")
        self.at_node = self.at_node or [0] * (self.budget + 1)

    def add(self, accepted_nodes: list[list[int]]) -> None:
        """Rounds of a decode at this curve's budget (`DecodeResult.accepted_nodes`)."""
        for nodes in accepted_nodes:
            self.rounds += 1
            for node in nodes:
                if not 1 <= node <= self.budget:
                    raise ValueError(f"node {node} is outside a tree of budget {self.budget}")
                self.at_node[node] += 1

    def tau(self) -> list[float]:
        """tau(b) for b = 1 … budget: 1 (the bonus token) + the mean count of path nodes numbered ≤ b."""
        taus, accepted = [], 0
        for node in range(1, self.budget + 1):
            accepted += self.at_node[node]
            taus.append(1 + accepted / max(self.rounds, 1))
        return taus

    def at(self, budget: int) -> float:
        if not 1 <= budget <= self.budget:
            raise ValueError(f"budget {budget} is outside this curve's 1–{self.budget}")
        return self.tau()[budget - 1]


@dataclass(frozen=True)
class Check:
    """The curve's estimate at a budget the run also decoded at, against that decode's measured tau."""

    budget: int
    estimate: float
    measured: float

    @property
    def error(self) -> float:
        return self.estimate - self.measured


def compare(curve: BudgetCurve, measured: dict[int, float]) -> list[Check]:
    """The estimate against every measured tau (budget → tau) at a budget the curve covers, by budget."""
    return [Check(b, curve.at(b), measured[b]) for b in sorted(measured) if 1 <= b <= curve.budget]


def curve_record(scope: str, curve: BudgetCurve, checks: list[Check]) -> dict[str, Any]:
    """The curve in `decode_summary.json`: the method it comes from, tau per budget, and its checks."""
    return {
        "scope": scope,
        "budget": curve.budget,
        "rounds": curve.rounds,
        "tau": curve.tau(),
        "checks": [
            {"budget": c.budget, "estimate": c.estimate, "measured": c.measured, "error": c.error} for c in checks
        ],
    }


def nearest_tau(curves: dict[int, BudgetCurve]) -> list[float]:
    """tau(b) for b = 1 … the largest budget decoded, each from the rounds of the smallest decoded budget at or
    above b (`curves`: decoded budget → its rounds): the rounds nearest b, whose start positions are most like
    a budget-b decode's (an estimate from a much larger budget reads high, the module says why)."""
    if not curves:
        raise ValueError("no DDTree decode to estimate tau from")
    decoded = sorted(curves)
    return [curves[next(d for d in decoded if d >= b)].at(b) for b in range(1, decoded[-1] + 1)]


def held_out_tau(curves: dict[int, BudgetCurve], budget: int) -> float:
    """tau at a decoded `budget` as `nearest_tau` would estimate it had that budget not been decoded: from the
    next larger decoded budget's rounds. The largest budget has none larger: its own rounds, its measured tau."""
    larger = [d for d in sorted(curves) if d > budget]
    return curves[larger[0] if larger else budget].at(budget)
