"""`ddtree_online`: DDTree that picks each round's budget from the drafter's confidence and the host's costs.

A fixed budget pays for every node of every round. But a round's value is not fixed: when the drafter is sure,
a large tree's extra nodes are likely accepted; when it is unsure, they are verified and thrown away. Each round
already knows both sides of that trade:

- the tree's path probabilities: node i of a best-first tree has the summed draft log-probability `score_i` of
  its path, so exp(score_i) is the draft's own probability that the target accepts the whole path to it, and
  a round's expected tokens at budget n are 1 (the bonus) + the sum of those probabilities over its first n
  nodes (a node counts once: it adds one token exactly when its path is accepted);
- the host's cost of a round at budget n (`cost_ms`, from the node-cost probe's measurements).

So a round grows the best-first tree to the largest budget B, as a fixed DDTree of B does, and verifies only its
first n nodes, n maximizing expected tokens over cost. By the prefix property (`tree_build`) those n nodes are
exactly the tree of budget n, so the round is a DDTree round of budget n: at temperature 0 its tokens are AR's,
at T > 0 the same exact sample-and-match verification.

A drafter's probabilities are not calibrated (a small drafter is overconfident deep in the block), so they are
corrected from the run's own history (`Calibration`): per depth and predicted-probability bin, how often a node
verified so far was accepted, shrunk toward the raw probability where the bin has few observations. Until
WARMUP_ROUNDS rounds were seen, or while the host's costs are not measured yet, the round uses a fixed budget.
The chosen n is always one of `sizes` (on a compiled path: the budgets whose rounds were captured, one graph
each, so nothing compiles during a decode).

`choose` computes every candidate's value from running sums; `choose_naive` computes each candidate from scratch,
the reference a test ties it to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from remote_worker.decoding.node_cost import NodeCosts, interpolate
from remote_worker.decoding.tree_build import DraftTree

WARMUP_ROUNDS = 16  # rounds at the fixed budget before the history is trusted
START_BUDGET = 32  # the fixed budget until then (the paper's best budgets on GPUs are 32 to 256)
PRIOR = 8.0  # pseudo-observations of the raw probability in every bin (shrinkage toward the drafter's own word)
BINS = 10  # predicted-probability bins of width 1 / BINS
DEPTH_BUCKETS = (1, 2, 3, 4, 6, 9)  # a bucket starts at each of these depths (depth 9 and deeper: the last)


def depth_bucket(depth: int) -> int:
    if depth < 1:
        raise ValueError(f"a drafted node has depth >= 1, not {depth}")
    return sum(1 for start in DEPTH_BUCKETS if depth >= start) - 1


def probability_bin(p: float) -> int:
    return min(int(p * BINS), BINS - 1)


@dataclass
class Calibration:
    """The run's history of verified nodes: per (depth bucket, probability bin), how many were verified, how many
    accepted, and the sum of their predicted probabilities (for the curve: predicted against accepted)."""

    seen: dict[tuple[int, int], int] = field(default_factory=dict)
    accepted: dict[tuple[int, int], int] = field(default_factory=dict)
    predicted: dict[tuple[int, int], float] = field(default_factory=dict)
    rounds: int = 0

    def observe(self, probabilities: Sequence[float], depths: Sequence[int], accepted: set[int]) -> None:
        """One verified round: node i (1-based, the root excluded) predicted `probabilities[i - 1]` at depth
        `depths[i - 1]`; `accepted` holds the node numbers on the accepted path."""
        for node, (p, depth) in enumerate(zip(probabilities, depths, strict=True), start=1):
            key = (depth_bucket(depth), probability_bin(p))
            self.seen[key] = self.seen.get(key, 0) + 1
            self.accepted[key] = self.accepted.get(key, 0) + (node in accepted)
            self.predicted[key] = self.predicted.get(key, 0.0) + p
        self.rounds += 1

    def calibrated(self, p: float, depth: int) -> float:
        """The probability that a node predicted at `p`, at `depth`, is accepted: its bin's accepted share,
        with PRIOR pseudo-observations at `p` itself."""
        key = (depth_bucket(depth), probability_bin(p))
        return (self.accepted.get(key, 0) + PRIOR * p) / (self.seen.get(key, 0) + PRIOR)

    def as_record(self) -> list[dict[str, Any]]:
        """The calibration curve: per bin with observations, the mean predicted probability and the share
        accepted (what the page draws, predicted against accepted)."""
        return [
            {
                "depths": _depth_label(bucket),
                "predicted": self.predicted[key] / self.seen[key],
                "accepted": self.accepted[key] / self.seen[key],
                "nodes": self.seen[key],
            }
            for key in sorted(self.seen)
            for bucket in (key[0],)
        ]


def _depth_label(bucket: int) -> str:
    start = DEPTH_BUCKETS[bucket]
    if bucket + 1 == len(DEPTH_BUCKETS):
        return f"{start}+"
    end = DEPTH_BUCKETS[bucket + 1] - 1
    return str(start) if end == start else f"{start}-{end}"


@dataclass
class OnlineBudget:
    """One method's policy over a run: the budgets it may verify, the fixed one until it knows better, its
    history, and the host's round cost at budget n (None until measured)."""

    largest: int  # the tree each round grows (B)
    sizes: tuple[int, ...]  # the budgets a round may verify, increasing (a compiled path: those captured)
    fixed: int  # the budget before the history and the costs exist
    cost_ms: Callable[[int], float] | None = None
    calibration: Calibration = field(default_factory=Calibration)
    verified: dict[int, int] = field(default_factory=dict)  # budget -> rounds that verified it (every decode's)

    @classmethod
    def for_budgets(cls, budgets: Sequence[int]) -> OnlineBudget:
        """The policy of a run whose fixed budgets are `budgets`: the tree grows to the largest; a round may
        verify any of them or a power of two below the largest (the sizes a compiled path would capture);
        START_BUDGET (or the nearest size below it) until the policy is `ready`."""
        largest = max(budgets)
        sizes = tuple(sorted({*budgets, *(1 << k for k in range(largest.bit_length()) if 1 << k <= largest)}))
        return cls(largest, sizes, max(n for n in sizes if n <= max(START_BUDGET, sizes[0])))

    def as_record(self) -> dict[str, Any]:
        return {
            "largest": self.largest,
            "sizes": list(self.sizes),
            "fixed": self.fixed,
            "rounds_at_budget": {str(n): count for n, count in sorted(self.verified.items())},
            "calibration": self.calibration.as_record(),
            "costs": self.cost_ms is not None,
        }

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"sizes {self.sizes} must be increasing positive budgets")
        if self.sizes[-1] > self.largest or self.fixed not in self.sizes:
            raise ValueError(f"the fixed budget {self.fixed} and every size must be among {self.sizes}, at most "
                             f"{self.largest}")  # fmt: skip

    @property
    def ready(self) -> bool:
        return self.cost_ms is not None and self.calibration.rounds >= WARMUP_ROUNDS

    def choose(self, draft: DraftTree) -> int:
        """The budget this round verifies: the fixed one until `ready`, then the size of most expected tokens per
        millisecond over this tree's nodes (ties: the smaller)."""
        grown = draft.tree.size - 1
        candidates = [n for n in self.sizes if n <= grown] or [min(self.sizes[0], grown)]
        if not self.ready or self.cost_ms is None:
            return min(self.fixed, grown)
        depths = draft.tree.depths.tolist()
        gains, total = [0.0], 0.0
        for node in range(1, candidates[-1] + 1):
            total += self.calibration.calibrated(math.exp(draft.scores[node]), depths[node])
            gains.append(total)
        return max(candidates, key=lambda n: ((1 + gains[n]) / self.cost_ms(n), -n))

    def choose_naive(self, draft: DraftTree) -> int:
        """`choose`, each candidate's expected tokens summed afresh (the reference)."""
        grown = draft.tree.size - 1
        candidates = [n for n in self.sizes if n <= grown] or [min(self.sizes[0], grown)]
        if not self.ready or self.cost_ms is None:
            return min(self.fixed, grown)
        depths = draft.tree.depths.tolist()
        best, best_value = candidates[0], -1.0
        for n in candidates:
            expected = 1 + sum(
                self.calibration.calibrated(math.exp(draft.scores[i]), depths[i]) for i in range(1, n + 1)
            )
            value = expected / self.cost_ms(n)
            if value > best_value:
                best, best_value = n, value
        return best

    def observe(self, draft: DraftTree, path: list[int]) -> None:
        """The verified tree of this round (its first n nodes) and the accepted path through it."""
        depths = draft.tree.depths.tolist()
        probabilities = [math.exp(score) for score in draft.scores[1:]]
        self.calibration.observe(probabilities, depths[1:], set(path[1:]))
        budget = draft.tree.size - 1
        self.verified[budget] = self.verified.get(budget, 0) + 1


def online_cost(costs: NodeCosts, largest: int) -> Callable[[int], float]:
    """A `ddtree_online` round's milliseconds at budget n, from the node-cost probe: the round of budget n
    (`NodeCosts.round_ms`) with its tree build at the largest budget, which every online round pays."""
    grown = interpolate(costs.sizes, costs.tree, largest + 1)
    return lambda n: costs.round_ms(n) - interpolate(costs.sizes, costs.tree, n + 1) + grown
