"""The prefill in fixed shapes: every chunk the same size (the last one padded), so one compiled graph serves
every chunk of every prompt, as `fixed_round` does for the decode rounds.

A chunk is a chain of `chunk` nodes verified and committed through the same fixed-shape paths as a round
(`TargetModel.verify_fixed`, `HybridCache.commit_fixed`): the padding sits after the real tokens, so no
real token attends to it (a chain is causal) and the commit's count leaves it out of the GDN state and
the committed K/V. The prompt comes from the host, so each chunk copies its tokens over: the only transfer
here, and a prefill's, not a round's.
"""

from __future__ import annotations

import torch

from remote_worker.decoding.fixed_round import compiled_entry
from remote_worker.models.target import TargetModel


class FixedPrefill:
    """One cache of fixed capacity that every prompt is prefilled into (`__call__`), chunk by chunk."""

    def __init__(self, target: TargetModel, capacity: int, chunk: int, hidden_layers: tuple[int, ...] = ()) -> None:
        if chunk < 1:
            raise ValueError(f"a prefill chunk needs at least one token, not {chunk}")
        self.target, self.capacity, self.chunk, self.hidden_layers = target, capacity, chunk, tuple(hidden_layers)
        device = target.device
        target.reserve_positions(capacity)
        self.cache = target.new_cache(capacity)
        self.cache.to_device_length()
        self.tokens = torch.zeros(chunk, dtype=torch.long, device=device)  # this chunk's tokens, padded
        self.count = torch.zeros((), dtype=torch.long, device=device)  # how many of them are real
        self.parents = torch.arange(-1, chunk - 1, device=device)
        self.depths = torch.arange(chunk, device=device)
        self.run = self.step  # `compile` replaces it

    def compile(self, mode: str | None = None) -> None:
        """As `FixedRound.compile`: one graph, no break, buffers static for a CUDA graph."""
        cache = self.cache
        tensors = (cache.kv, cache.conv, cache.recurrent, cache.device_length, self.tokens, self.count)
        self.run = compiled_entry(self.step, mode, [t for t in tensors if t is not None])

    @torch.no_grad()
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify and commit the chunk in `tokens` (its first `count` real); returns the hidden states of
        `hidden_layers` for every position, concatenated on the feature axis ([chunk, F]; F = 0 without),
        and the last layer's output [chunk, hidden].

        Nothing reads the last layer's output (a prefill needs no logits), but it is returned all the same:
        a compiled graph drops a layer whose output nothing reads, and an attention layer's region writes
        its K/V inside (`models.blocks`), so the write went with it (torch 2.13: the last attention layer's
        K/V were never committed at 64 layers, whose last layer is no drafter's feature layer)."""
        last = self.target.num_layers
        output = self.target.verify_fixed(
            self.cache, self.tokens, self.parents, self.depths, self.chunk - 1, (*self.hidden_layers, last), False
        )
        path = torch.where(self.depths < self.count, self.depths, self.count - 1)
        self.cache.commit_fixed(path, self.count)
        if not self.hidden_layers:
            return self.tokens.new_zeros(self.chunk, 0, dtype=self.target.dtype), output.hidden[last]
        return torch.cat([output.hidden[i] for i in self.hidden_layers], dim=-1), output.hidden[last]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Commit `tokens` (host, 1-D) from an empty cache; returns their features [len(tokens), F]. The cache
        (`self.cache`) holds them until the next call."""
        total = int(tokens.shape[0])
        if total == 0:
            raise ValueError("prefill needs at least one token")
        if total + self.chunk > self.capacity:
            raise ValueError(f"a prompt of {total} tokens does not fit a prefill capacity of {self.capacity}")
        self.cache.clear()
        features = []
        for start in range(0, total, self.chunk):
            piece = tokens[start : start + self.chunk]
            self.tokens.zero_()
            self.tokens[: piece.shape[0]].copy_(piece)
            self.count.fill_(piece.shape[0])
            features.append(self.run()[0][: piece.shape[0]].clone())  # a captured graph reuses its output
        self.cache.length = total
        return torch.cat(features)
