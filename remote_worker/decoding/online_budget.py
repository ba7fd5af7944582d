"""`ddtree_online`: DDTree that picks each round's budget from the drafter's confidence and the host's costs.

A fixed budget pays for every node of every round. But a round's value is not fixed: when the drafter is sure,
a large tree's extra nodes are likely accepted; when it is unsure, they are verified and thrown away. Each round
already knows both sides of that trade:

- the tree's probabilities: a node of a best-first tree is accepted when its parent is and the target then
  picks its token. Its draft probability given the parent, q = exp(score - parent's score), is the drafter's
  guess of that; so the chance that the node is accepted is the product of those guesses along its path, and
  a round's expected tokens at budget n are 1 (the bonus) + the sum of those chances over its first n nodes
  (a node counts once: it adds one token exactly when its path is accepted);
- the host's cost of a round at budget n (`cost_ms`, from the node-cost probe's measurements).

So a round grows the best-first tree as far as the policy may want (`grow_to`), and verifies only its first n
nodes, n maximizing expected tokens over cost. Growing costs too (the heap's pops on the host, the device
tree's selections on a compiled round): growing to the largest budget B every round, as a fixed DDTree of B
does, paid for nodes most rounds never verify. So the tree grows to the last round's n, and past it (to the
smallest size of at least twice n, at most B) only when the last round verified all it had grown: a round that
chose the most it could see sees further next round, and one that looked further and found nothing worth it
goes back.
By the prefix property (`tree_build`) the first n nodes of a tree grown to any size are exactly the tree of
budget n, so the round is a DDTree round of budget n: at temperature 0 its tokens are AR's, at T > 0 the same
exact sample-and-match verification.

A drafter's guesses are not calibrated (a small drafter is overconfident deep in the block; at T > 0 a guess
is the draft's probability, not the target's), so each is corrected from the run's own history
(`Calibration`): per depth and guess bin, how often a node whose parent was accepted was accepted itself,
shrunk toward the guess where the bin has few observations. Why the step and not the whole path's product:
a bin of path products mixes a sure step below an unsure one with the reverse, which the bin cannot tell
apart; a step's bin holds steps alike, and a deep node's chance stays tied to the steps above it.

Until WARMUP_ROUNDS rounds were seen, or while the host's costs are not measured yet, the round uses a fixed
budget. The chosen n is always one of `sizes`: on the reference round the run's budgets and the powers of two
below the largest; on a compiled round (`online_round`) the run's budgets only, each a graph captured before
the decodes, priced by what the round measures of its own two stages (`OnlineBudget.priced`).

The policy runs every round on the host, between the draft and the verify, so it is plain lists and one pass:
`choose` accumulates each node's chance from its parent's; `choose_naive` computes every node's chance afresh
from its path to the root, the reference a test ties it to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from remote_worker.decoding.node_cost import NodeCosts, interpolate
from remote_worker.decoding.tree_build import DraftTree, Growth

WARMUP_ROUNDS = 4  # rounds at the fixed budget before the history is used (the prior holds a bin until it fills)
START_BUDGET = 32  # the fixed budget until then (the paper's best budgets on GPUs are 32 to 256)
PRIOR = 8.0  # pseudo-observations of the drafter's own guess in every bin (shrinkage toward its word)
BINS = 10  # guess bins of width 1 / BINS
DEPTH_BUCKETS = (1, 2, 3, 4, 6, 9)  # a bucket starts at each of these depths (depth 9 and deeper: the last)
_DEEPEST = DEPTH_BUCKETS[-1]
_BUCKET_OF = [-1] + [sum(1 for start in DEPTH_BUCKETS if d >= start) - 1 for d in range(1, _DEEPEST + 1)]


def _start(sizes: Sequence[int]) -> int:
    """The fixed budget among `sizes` (increasing): START_BUDGET, or the nearest size below it (the smallest)."""
    return max(n for n in sizes if n <= max(START_BUDGET, sizes[0]))


def depth_bucket(depth: int) -> int:
    if depth < 1:
        raise ValueError(f"a drafted node has depth >= 1, not {depth}")
    return _BUCKET_OF[min(depth, _DEEPEST)]


def probability_bin(p: float) -> int:
    """The guess's bin; a guess of 1 or a rounding past it in the last, one that is not a number (a drafter's
    NaN logits) in the first: a bad number must not stop the decode, whose tokens are the target's anyway."""
    if not 0.0 <= p < 1.0:
        return BINS - 1 if p >= 1.0 else 0
    return int(p * BINS)


def _cell(depth: int, q: float) -> int:
    """The flat index of (depth bucket, guess bin) in `Calibration`'s lists."""
    return _BUCKET_OF[min(depth, _DEEPEST)] * BINS + probability_bin(q)


@dataclass
class Calibration:
    """The run's history of verified steps: per (depth bucket, guess bin), flattened (`_cell`), how many nodes
    whose parent was accepted were verified, how many of them were accepted, and the sum of their guesses (for
    the curve: predicted against accepted). A node whose parent was not accepted says nothing of its own step."""

    seen: list[int] = field(default_factory=lambda: [0] * (len(DEPTH_BUCKETS) * BINS))
    accepted: list[int] = field(default_factory=lambda: [0] * (len(DEPTH_BUCKETS) * BINS))
    predicted: list[float] = field(default_factory=lambda: [0.0] * (len(DEPTH_BUCKETS) * BINS))
    rounds: int = 0

    def observe(self, guesses: Sequence[float], depths: Sequence[int], accepted: Sequence[bool]) -> None:
        """One verified round's informative steps: each node whose parent was accepted guessed
        `guesses[k]` at `depths[k]`, and was accepted or not."""
        for q, depth, hit in zip(guesses, depths, accepted, strict=True):
            if not math.isfinite(q):  # a guess that is no number teaches nothing (and would spoil the curve)
                continue
            cell = _cell(depth, q)
            self.seen[cell] += 1
            self.accepted[cell] += hit
            self.predicted[cell] += q
        self.rounds += 1

    def calibrated(self, q: float, depth: int) -> float:
        """The chance that a node guessed at `q` given its parent, at `depth`, is accepted when its parent is: its
        bin's accepted share, with PRIOR pseudo-observations at `q` itself."""
        cell = _cell(depth, q)
        return (self.accepted[cell] + PRIOR * q) / (self.seen[cell] + PRIOR)

    def as_record(self) -> list[dict[str, Any]]:
        """The calibration curve: per bin with observations, the mean guess and the share accepted (what the
        page draws, predicted against accepted)."""
        return [
            {
                "depths": _depth_label(cell // BINS),
                "predicted": self.predicted[cell] / seen,
                "accepted": self.accepted[cell] / seen,
                "nodes": seen,
            }
            for cell, seen in enumerate(self.seen)
            if seen
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

    largest: int  # the most a round's tree grows (B)
    sizes: tuple[int, ...]  # the budgets a round may verify, increasing (a compiled path: those captured)
    fixed: int  # the budget before the history and the costs exist
    budgets: tuple[int, ...] = ()  # the run's fixed budgets (what a compiled path captures: `captured`)
    cost_ms: Callable[[int], float] | None = None  # a round at budget n, its tree grown to n (`NodeCosts.round_ms`)
    tree_ms: Callable[[int], float] | None = None  # growing a tree of n nodes, root included (None: free)
    calibration: Calibration = field(default_factory=Calibration)
    verified: dict[int, int] = field(default_factory=dict)  # budget -> rounds that verified it (every decode's)
    last: int = 0  # the budget the last round verified (0: none yet)
    _grown: int = field(default=0, init=False, repr=False)  # the nodes of the tree the last choice was made over

    @classmethod
    def for_budgets(cls, budgets: Sequence[int]) -> OnlineBudget:
        """The policy of a run whose fixed budgets are `budgets`: the tree grows to the largest; a round may
        verify any of them or a power of two below the largest (a compiled round: `captured`);
        START_BUDGET (or the nearest size below it) until the policy is `ready`."""
        largest = max(budgets)
        sizes = tuple(sorted({*budgets, *(1 << k for k in range(largest.bit_length()) if 1 << k <= largest)}))
        return cls(largest, sizes, _start(sizes), tuple(sorted(set(budgets))))

    def captured(self) -> OnlineBudget:
        """A fresh policy for a compiled round, whose every size is a graph captured before the decodes (no
        recompile during one): the run's budgets only, each already a size the run pays to compile for its
        fixed rounds (the powers of two below would each be one more graph of the whole target)."""
        sizes = self.budgets or self.sizes
        return OnlineBudget(self.largest, sizes, _start(sizes), sizes)

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

    def reset_history(self) -> None:
        """Forget every round seen (a warm-up's), keeping the costs."""
        self.calibration, self.verified, self.last, self._grown = Calibration(), {}, 0, 0

    def measured(self, costs: NodeCosts) -> None:
        """The host's costs as the node-cost probe measured them so far: the choices use them from now on."""
        self.cost_ms = costs.round_ms
        self.tree_ms = lambda nodes: interpolate(costs.sizes, costs.tree, nodes)

    def priced(self, cost_ms: Callable[[int], float], tree_ms: Callable[[int], float]) -> None:
        """Costs measured some other way than by the node-cost probe (a compiled round's, `online_round`): a
        round at budget n, its tree grown to n, and growing a tree of n nodes (root included)."""
        self.cost_ms, self.tree_ms = cost_ms, tree_ms

    @property
    def ready(self) -> bool:
        return self.cost_ms is not None and self.calibration.rounds >= WARMUP_ROUNDS

    def grow_to(self) -> int:
        """How far this round's tree grows: the fixed budget until `ready`; then, when the last round verified
        the whole tree it grew (it chose the most it could see), the smallest size of at least twice its budget
        (the largest where none is); else that budget again (the smallest size where nothing was verified
        yet). So a tree grows past what is verified only to look further, and a round that looked and found
        nothing worth it goes back: growth costs (the heap's pops, the device tree's selections)."""
        if not self.ready:
            return self.fixed
        full = self.last >= self._grown  # it verified the whole tree it grew: it would have verified more
        wanted = 2 * self.last if full else self.last
        return next((n for n in self.sizes if n >= wanted), self.sizes[-1])

    def _round_ms(self, n: int, grown: int) -> float:
        """A round that verifies n nodes of a tree grown to `grown` nodes (root excluded)."""
        assert self.cost_ms is not None
        if self.tree_ms is None:
            return self.cost_ms(n)
        return self.cost_ms(n) - self.tree_ms(n + 1) + self.tree_ms(grown + 1)

    def _candidates(self, nodes: int) -> list[int]:
        return [n for n in self.sizes if n <= nodes] or [min(self.sizes[0], nodes)]

    def choose(self, grown: Growth) -> int:
        """The budget this round verifies: the fixed one until `ready`, then the size of most expected tokens per
        millisecond over this tree's nodes (ties: the smaller)."""
        return self.choose_tree(grown.scores, grown.parents, grown.depths)

    def choose_tree(self, scores: Sequence[float], parents: Sequence[int], depths: Sequence[int]) -> int:
        """`choose` over a tree given as its nodes' scores, parents and depths (node 0 the root). Padding (a
        score of -inf, as a fixed-shape tree has where the candidates ran out) has no chance of acceptance,
        so it is never worth its cost."""
        nodes = self._grown = len(scores) - 1
        if not self.ready or self.cost_ms is None:
            return min(self.fixed, nodes)
        candidates = self._candidates(nodes)
        seen, accepted = self.calibration.seen, self.calibration.accepted
        chance, gains, total = [1.0], [0.0], 0.0
        for node in range(1, candidates[-1] + 1):
            parent = parents[node]
            q = math.exp(scores[node] - scores[parent])
            cell = _cell(depths[node], q)
            step = (accepted[cell] + PRIOR * q) / (seen[cell] + PRIOR) if q != 0.0 else 0.0  # padding: no token
            chance.append(chance[parent] * step)
            total += chance[-1]
            gains.append(total)
        if not math.isfinite(total):  # a draft whose numbers are no numbers: the fixed budget
            return min(self.fixed, nodes)
        return max(candidates, key=lambda n: ((1 + gains[n]) / self._round_ms(n, nodes), -n))

    def choose_naive(self, grown: Growth) -> int:
        """`choose`, each node's chance the product of its path's calibrated steps, walked afresh (the reference)."""
        if not self.ready or self.cost_ms is None:
            return min(self.fixed, grown.nodes)

        def chance(node: int) -> float:
            path = [node]
            while path[-1] != 0:
                path.append(grown.parents[path[-1]])
            product = 1.0
            for parent, child in zip(path[:0:-1], path[-2::-1], strict=True):  # from the root down
                q = math.exp(grown.scores[child] - grown.scores[parent])
                product *= self.calibration.calibrated(q, grown.depths[child]) if q != 0.0 else 0.0
            return product

        candidates = self._candidates(grown.nodes)
        if not math.isfinite(sum(chance(i) for i in range(1, candidates[-1] + 1))):
            return min(self.fixed, grown.nodes)
        best, best_value = 0, -1.0
        for n in candidates:
            value = (1 + sum(chance(i) for i in range(1, n + 1))) / self._round_ms(n, grown.nodes)
            if value > best_value:
                best, best_value = n, value
        return best

    def observe(self, draft: DraftTree, path: list[int]) -> None:
        """The verified tree of this round (its first n nodes) and the accepted path through it."""
        self.observe_tree(draft.scores, draft.tree.parents.tolist(), draft.tree.depths.tolist(), path)

    def observe_tree(
        self, scores: Sequence[float], parents: Sequence[int], depths: Sequence[int], path: Sequence[int]
    ) -> None:
        """`observe` of a tree given as its verified nodes' scores, parents and depths (node 0 the root) and the
        accepted path (root first). Padding (score -inf) was never a guess: it teaches nothing."""
        on_path = set(path)
        steps = [node for node in range(1, len(parents)) if parents[node] in on_path and scores[node] != -math.inf]
        self.calibration.observe(
            [math.exp(scores[node] - scores[parents[node]]) for node in steps],
            [depths[node] for node in steps],
            [node in on_path for node in steps],
        )
        budget = len(parents) - 1
        self.verified[budget] = self.verified.get(budget, 0) + 1
        self.last = budget
