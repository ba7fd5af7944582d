"""`ddtree_online` in fixed shapes: the compiled and CUDA-graph path of the per-round budget (`online_budget`).

A compiled round (`fixed_round`) has every shape fixed, and a per-round budget is a shape. So the round is split
where the policy has to look: a draft graph drafts and builds the best-first tree of G nodes on the device, into
buffers the round owns; the host reads the tree's scores, parents and depths (one transfer of 3 × (G + 1)
numbers), the policy chooses n ≤ G, and a verify graph verifies the tree's first n + 1 nodes and commits the
accepted path (the round's second transfer: `fixed_round.run_rounds`'s).

- G and n are both sizes of `policy.sizes` (the run's budgets: `OnlineBudget.captured`): one draft graph and one
  verify graph per size, all compiled and captured by `warm_every_size` before the decodes, so no decode
  compiles (`CompiledRounds.recompiles`). G is the policy's `grow_to`, as on the reference round (the last
  round's n, or twice it when that round verified all it grew), so a round does not pay for the largest tree
  when it verifies a small one.
- The tree of G nodes' first n + 1 nodes are the tree of budget n (`DeviceTree.prefix`), so a round is a DDTree
  round of budget n, exact as every fixed round is.
- What a round costs is what this round measures, not the reference round's node costs: the two transfers
  synchronise, so the host clock times the draft stage (at G) and the verify stage (at n) apart at no extra
  sync: the draft stage (the draft graph and the tree's transfer) and the verify stage (the choice, the verify
  graph, the result's transfer and the policy's bookkeeping of it). The warm-up times each size's two stages,
  and each decoded round adds its own two times to their windows; the policy prices a round at (n, G) as
  verify(n) + draft(G) (`OnlineBudget.priced`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from remote_worker.decoding.device_tree import DeviceTree
from remote_worker.decoding.fixed_round import FixedRound, RoundOutput, compiled_entry
from remote_worker.decoding.online_budget import OnlineBudget
from remote_worker.models.target import TargetModel

WINDOW = 32  # a stage's cost at a size is the median of its last WINDOW times
TIMED_WARMUP_ROUNDS = 3  # rounds timed per size in the warm-up, after the two that compile and capture it
_TREE_PARTS = tuple(part.name for part in fields(DeviceTree))  # names, read before tracing: dynamo reads strings


class OnlineRound(FixedRound):
    """`FixedRound` of budget B = `policy.largest` whose rounds grow the tree to the policy's G and verify as
    many of its nodes as the policy chooses (both among `policy.sizes`). `run` is the host's side of a round
    between the two graphs; `seen` tells the policy what was accepted and times the round's two stages."""

    one_size = False

    def __init__(
        self,
        target: TargetModel,
        capacity: int,
        *,
        drafter: Any,
        policy: OnlineBudget,
        temperature: float = 0.0,
    ) -> None:
        super().__init__(target, "ddtree", capacity, drafter=drafter, budget=policy.largest, temperature=temperature)
        self.policy = policy
        n, device = self.budget + 1, target.device
        self.tree = DeviceTree(
            tokens=torch.zeros(n, dtype=torch.long, device=device),
            parents=torch.zeros(n, dtype=torch.long, device=device),
            depths=torch.zeros(n, dtype=torch.long, device=device),
            valid=torch.zeros(n, dtype=torch.bool, device=device),
            scores=torch.zeros(n, dtype=torch.float64, device=device),
            ranks=torch.zeros(n, dtype=torch.long, device=device),
            exact=torch.ones((), dtype=torch.bool, device=device),
        )
        self.drafts: dict[int, Callable[[], torch.Tensor]] = {size: self._draft_at(size) for size in policy.sizes}
        self.verifies: dict[int, Callable[[], RoundOutput]] = {size: self._verify_at(size) for size in policy.sizes}
        self.draft_times = {size: Window() for size in policy.sizes}  # ms of the draft stage, by tree size G
        self.verify_times = {size: Window() for size in policy.sizes}  # ms of the verify stage, by budget n
        self.grown = self.chosen = policy.fixed
        self._clock: tuple[list[float], list[int], list[int], float, float] | None = None
        self.run = self.online_round

    @property
    def round_nodes(self) -> int:
        return self.chosen + 1

    def buffers(self) -> list[torch.Tensor]:
        return super().buffers() + self._tree_buffers()

    def _tree_buffers(self, tree: DeviceTree | None = None) -> list[torch.Tensor]:
        """Every tensor of `tree` (the round's own buffers by default), in the dataclass's order."""
        return [getattr(tree or self.tree, name) for name in _TREE_PARTS]

    def _draft_at(self, size: int) -> Callable[[], torch.Tensor]:
        @torch.no_grad()
        def draft_tree() -> torch.Tensor:
            """The draft and its tree of `size` nodes into the buffers' first `size` + 1; returns what the
            policy reads, float64 [3, size + 1]: each node's score, parent and depth (exact in float64)."""
            tree = self.draft(size)
            for buffer, value in zip(self._tree_buffers(self.tree.prefix(size)), self._tree_buffers(tree), strict=True):
                buffer.copy_(value)
            return torch.stack([tree.scores, tree.parents.double(), tree.depths.double()])

        return draft_tree

    def _verify_at(self, size: int) -> Callable[[], RoundOutput]:
        def verify() -> RoundOutput:
            return self.verify_commit(self.tree.prefix(size))

        return verify

    def compile(self, mode: str | None = None) -> None:
        """One draft and one verify graph per size (`compiled_entry`), every buffer they update static."""
        tensors = self.buffers()
        self.drafts = {size: compiled_entry(draft, mode, tensors) for size, draft in self.drafts.items()}
        self.verifies = {size: compiled_entry(verify, mode, tensors) for size, verify in self.verifies.items()}

    def online_round(self) -> RoundOutput:
        """Draft at the policy's G, read the tree, choose n, verify n (`seen` ends the round once its result
        is read)."""
        self.grown = self.policy.grow_to()
        started = time.perf_counter()
        scores, parents, depths = self.drafts[self.grown]().tolist()
        drafted = time.perf_counter()
        parents, depths = [int(p) for p in parents], [int(d) for d in depths]
        self.chosen = self.policy.choose_tree(scores, parents, depths)
        if self.chosen not in self.verifies or self.chosen > self.grown:  # `choose_tree` picks among the sizes
            raise AssertionError(f"the policy chose {self.chosen} of a tree of {self.grown}, captured sizes "
                                 f"{self.policy.sizes}")  # fmt: skip
        self._clock = (scores, parents, depths, started, drafted)
        return self.verifies[self.chosen]()

    def seen(self, path: list[int]) -> None:
        assert self._clock is not None, "seen() before a round"
        scores, parents, depths, started, drafted = self._clock
        end = self.chosen + 1
        self.policy.observe_tree(scores[:end], parents[:end], depths[:end], path)
        self.draft_times[self.grown].add(1000 * (drafted - started))
        self.verify_times[self.chosen].add(1000 * (time.perf_counter() - drafted))
        self._clock = None

    def cost_ms(self, budget: int) -> float:
        """A round at `budget` (one of the sizes), its tree grown to `budget`: both stages' medians."""
        return self.draft_times[budget].median + self.verify_times[budget].median

    def tree_ms(self, nodes: int) -> float:
        """The draft stage of a tree of `nodes` nodes, root included (`nodes` - 1 one of the sizes)."""
        return self.draft_times[nodes - 1].median

    def warm_every_size(self, reset: Callable[[int], None]) -> None:
        """Compile (the first call) and capture (the second) every size's two graphs, then time
        TIMED_WARMUP_ROUNDS rounds at each, each round from `reset(attempt)`'s state (a prompt's prefill);
        from then on the policy prices its choices with these costs. What these rounds accepted is not
        history: the policy starts the decodes knowing only the costs."""
        for size in self.policy.sizes:
            for attempt in range(2 + TIMED_WARMUP_ROUNDS):
                reset(attempt)
                started = time.perf_counter()
                self.drafts[size]().tolist()
                drafted = time.perf_counter()
                self.verifies[size]().packed.tolist()
                if attempt >= 2:
                    self.draft_times[size].add(1000 * (drafted - started))
                    self.verify_times[size].add(1000 * (time.perf_counter() - drafted))
        self.policy.reset_history()
        self.policy.priced(self.cost_ms, self.tree_ms)


class Window:
    """The last WINDOW times of one stage at one size, and their median (kept, since the policy reads it for
    every candidate of every round)."""

    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.median = math.nan

    def add(self, ms: float) -> None:
        self.times.append(ms)
        self.median = statistics.median(self.times)

    def __len__(self) -> int:
        return len(self.times)
