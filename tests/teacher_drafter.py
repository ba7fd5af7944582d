"""A test double for a trained drafter: it knows the AR continuation and ranks it high, often but not always.

A random drafter is almost never right, so trees would rarely be accepted past the root; this one makes the
decode loops commit long paths, take side branches and stop mid-tree, which is what exactness must survive.
"""

from __future__ import annotations

import torch
from torch import nn


class TeacherContext:
    """The teacher's whole state: how many tokens are committed."""

    def __init__(self, committed: int = 0) -> None:
        self.committed = committed

    def clone(self) -> TeacherContext:
        return TeacherContext(self.committed)

    def reserve(self, needed: int) -> None:
        """Nothing to reserve: the teacher keeps no buffers."""

    def load(self, other: TeacherContext) -> None:
        self.committed = other.committed

    def to_device_length(self) -> torch.Tensor:
        """Fixed-shape rounds: the teacher keeps its count on the host (it is a test double, not compiled)."""
        return torch.tensor(self.committed)


class TeacherDrafter:
    def __init__(self, sequence: list[int], vocab: int, block_size: int, seed: int, hit_rate: float = 0.7) -> None:
        self.sequence = sequence  # prompt + AR continuation
        self.vocab = vocab
        self.block_size = block_size
        self.seed = seed
        self.hit_rate = hit_rate
        self.mask_token_id = vocab - 1
        self.feature_layers = (1,)  # asks for features only to learn the committed length

    def new_context(self, capacity: int = 0) -> TeacherContext:
        return TeacherContext()

    def extend(self, context: TeacherContext, features: torch.Tensor) -> None:
        context.committed += features.shape[0]

    def extend_fixed(self, context: TeacherContext, features: torch.Tensor, count: torch.Tensor) -> None:
        context.committed += int(count)

    def propose_fixed(
        self, context: TeacherContext, root_embedding: torch.Tensor, mask_embedding: torch.Tensor, head: nn.Module
    ) -> torch.Tensor:
        return self.propose(context, root_embedding, mask_embedding, head)

    def propose(
        self, context: TeacherContext, root_embedding: torch.Tensor, mask_embedding: torch.Tensor, head: nn.Module
    ) -> torch.Tensor:
        """Like a trained drafter, peaked: three candidates per position hold most of the mass. With probability
        `hit_rate` the right token is one of them, at rank 0 (a chain finds it) or rank 1-2 (only a tree does)."""
        generator = torch.Generator().manual_seed(self.seed * 100_003 + context.committed)
        logits = torch.randn(self.block_size - 1, self.vocab, generator=generator, dtype=torch.float64)
        for j in range(1, self.block_size):
            candidates = torch.randperm(self.vocab - 1, generator=generator)[:3].tolist()
            position = context.committed + j  # the root sits at position `committed`
            if position < len(self.sequence) and torch.rand(1, generator=generator).item() < self.hit_rate:
                truth = self.sequence[position]
                candidates = [c for c in candidates if c != truth][:2]
                candidates.insert(int(torch.randint(0, 3, (1,), generator=generator)), truth)
            for rank, token in enumerate(candidates):
                logits[j - 1, token] = 8.0 - 0.5 * rank
        return torch.log_softmax(logits, dim=-1)
