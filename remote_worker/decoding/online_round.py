"""`ddtree_online` in fixed shapes: the compiled and CUDA-graph path of the per-round budget (`online_budget`).

A compiled round (`fixed_round`) has every shape fixed, and a per-round budget is a shape. So the round is split
where the policy has to look: one graph drafts and builds the tree of the largest budget B on the device, into
buffers the round owns; the host reads the tree's scores, parents and depths (one transfer of 3 × (B + 1)
numbers), the policy chooses n among the captured sizes, and the graph of size n verifies the tree's first
n + 1 nodes and commits the accepted path (the round's second transfer: `fixed_round.run_rounds`'s).

- One verify graph per size in `policy.sizes` (the run's budgets: `OnlineBudget.captured`), each compiled and
  captured by `warm_every_size` before the decodes, so no decode compiles (`CompiledRounds.recompiles`).
- The tree is the whole B-node best-first tree every round; its first n + 1 nodes are the tree of budget n
  (`DeviceTree.prefix`), so a round is a DDTree round of budget n, exact as every fixed round is.
- What a round costs at each size is what this round measures, not the reference round's node costs: the
  warm-up times each size whole (draft graph, both transfers, verify graph), and each decoded round adds its
  own time to its size's window (the transfers synchronise, so the host clock sees the device's work).
"""

from __future__ import annotations

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

WINDOW = 32  # a size's cost is the median of its last WINDOW rounds' times
TIMED_WARMUP_ROUNDS = 3  # rounds timed per size in the warm-up, after the two that compile and capture it
_TREE_PARTS = tuple(part.name for part in fields(DeviceTree))  # names, read before tracing: dynamo reads strings


class OnlineRound(FixedRound):
    """`FixedRound` of budget B = `policy.largest` whose rounds verify as many of the tree's nodes as the
    policy chooses (one of `policy.sizes`). `run` is the host-side round between the two graphs; `seen` tells
    the policy what was accepted and adds the round's time to its size's costs."""

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
        self.drafts: Callable[[], torch.Tensor] = self.draft_tree
        self.verifies: dict[int, Callable[[], RoundOutput]] = {size: self._verify_at(size) for size in policy.sizes}
        self.times: dict[int, deque[float]] = {size: deque(maxlen=WINDOW) for size in policy.sizes}
        self.costs: dict[int, float] = {}  # size -> median ms of its window
        self.chosen = policy.fixed
        self._round: tuple[list[float], list[int], list[int], float] | None = None
        self.run = self.online_round

    @property
    def round_nodes(self) -> int:
        return self.chosen + 1

    def _tree_buffers(self, tree: DeviceTree | None = None) -> list[torch.Tensor]:
        """Every tensor of `tree` (the round's own buffers by default), in the dataclass's order."""
        return [getattr(tree or self.tree, name) for name in _TREE_PARTS]

    @torch.no_grad()
    def draft_tree(self) -> torch.Tensor:
        """The draft and the B-node tree into the round's buffers; returns what the policy reads, float64
        [3, B + 1]: each node's score, parent and depth (parents and depths exact in float64)."""
        tree = self.draft()
        for buffer, value in zip(self._tree_buffers(), self._tree_buffers(tree), strict=True):
            buffer.copy_(value)
        return torch.stack([tree.scores, tree.parents.double(), tree.depths.double()])

    def _verify_at(self, size: int) -> Callable[[], RoundOutput]:
        def verify() -> RoundOutput:
            return self.verify_commit(self.tree.prefix(size))

        return verify

    def compile(self, mode: str | None = None) -> None:
        """The draft graph and one verify graph per size (`compiled_entry`), every buffer they update static."""
        cache, context = self.cache, self.context
        tensors = [cache.kv, cache.conv, cache.recurrent, cache.device_length, self.root, self.seed, self.draws]
        if context is not None and hasattr(context, "buffer"):
            tensors += [context.buffer, context.device_length]
        tensors = [t for t in tensors + self._tree_buffers() if t is not None]
        self.drafts = compiled_entry(self.draft_tree, mode, tensors)
        self.verifies = {size: compiled_entry(self._verify_at(size), mode, tensors) for size in self.policy.sizes}

    def online_round(self) -> RoundOutput:
        """Draft, read the tree, choose n, verify n (`seen` completes the round once its result is read)."""
        started = time.perf_counter()
        scores, parents, depths = self.drafts().tolist()
        parents, depths = [int(p) for p in parents], [int(d) for d in depths]
        self.chosen = self.policy.choose_tree(scores, parents, depths)
        if self.chosen not in self.verifies:  # `choose_tree` picks among the sizes; a tree never has fewer nodes
            raise AssertionError(f"the policy chose {self.chosen}, not one of the captured sizes {self.policy.sizes}")
        self._round = (scores, parents, depths, started)
        return self.verifies[self.chosen]()

    def seen(self, path: list[int]) -> None:
        assert self._round is not None, "seen() before a round"
        scores, parents, depths, started = self._round
        end = self.chosen + 1
        self.policy.observe_tree(scores[:end], parents[:end], depths[:end], path)
        self._timed(self.chosen, 1000 * (time.perf_counter() - started))
        self._round = None

    def _timed(self, size: int, ms: float) -> None:
        window = self.times[size]
        window.append(ms)
        self.costs[size] = statistics.median(window)

    def cost_ms(self, budget: int) -> float:
        """The measured cost of a round at `budget`, one of the sizes."""
        return self.costs[budget]

    def warm_every_size(self, reset: Callable[[int], None]) -> None:
        """Compile (the first call) and capture (the second) every size's graph, then time TIMED_WARMUP_ROUNDS
        rounds at each, each round from `reset(attempt)`'s state (a prompt's prefill); from then on the policy
        prices its choices with these costs. What these rounds accepted is not history: the policy starts the
        decodes knowing only the costs."""
        for size in self.policy.sizes:
            for attempt in range(2 + TIMED_WARMUP_ROUNDS):
                reset(attempt)
                started = time.perf_counter()
                scores, parents, depths = self.drafts().tolist()
                self.policy.choose_tree(scores, parents, [int(d) for d in depths])
                self.verifies[size]().packed.tolist()
                if attempt >= 2:
                    self._timed(size, 1000 * (time.perf_counter() - started))
        self.policy.reset_history()
        self.policy.priced(self.cost_ms)
