"""Where a method's acceptance comes from: how deep its accepted paths reach, and which of the draft's
choices they took at each depth.

For every round the accepted path below the root is a node per depth, and each node has a rank among its
parent's draft candidates (0: the draft's first choice; `DraftTree.ranks`, `DeviceTree.ranks`). Counting
(depth, rank) over the rounds gives a depth × rank table whose row d sums to the share of rounds that reach
depth d. A table whose mass sits in rank 0 and fades with depth says the tree would gain from depth (a
longer block); mass in ranks past 0 says width pays. DFlash's chain has rank 0 only: its rows are its depth
profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AcceptanceProfile:
    """Counts over rounds: `counts[d - 1][r]` rounds whose accepted node at depth d was rank r."""

    rounds: int = 0
    counts: list[list[int]] = field(default_factory=list)

    def add(self, accepted_ranks: list[list[int]]) -> None:
        """Rounds of a decode (`DecodeResult.accepted_ranks`: per round, the rank of each path node by depth)."""
        for ranks in accepted_ranks:
            self.rounds += 1
            for depth, rank in enumerate(ranks):
                if depth == len(self.counts):
                    self.counts.append([])
                row = self.counts[depth]
                row.extend([0] * (rank + 1 - len(row)))
                row[rank] += 1

    def shares(self) -> list[list[float]]:
        """[depth][rank] share of all rounds, every row padded to the widest rank seen."""
        width = max((len(row) for row in self.counts), default=0)
        total = max(self.rounds, 1)
        return [[(row[r] if r < len(row) else 0) / total for r in range(width)] for row in self.counts]

    def reach(self) -> list[float]:
        """Per depth d = 1, 2, …: the share of rounds whose accepted path reaches depth d."""
        return [sum(row) / max(self.rounds, 1) for row in self.counts]

    def as_record(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "counts": self.counts, "reach": self.reach()}
