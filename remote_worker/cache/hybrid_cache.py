"""One cache for AR, DFlash and DDTree on hybrid and dense models.

`verify` runs a tree's nodes through the layers without touching the committed state: full-attention layers
write the tree's K/V into the window just past the committed length, Gated DeltaNet layers keep what commit
needs (pre-conv inputs, keys, deltas, decay sums). `commit(path)` then makes the accepted path part of the
committed state, once, with no re-run: K/V of the path are compacted to the front of the window, the GDN
recurrent state is advanced in closed form and its conv state becomes the path's last inputs. A rejected
branch therefore costs nothing to roll back.

Storage is pre-allocated and shared by the layers of a kind, as in gpt-fast: every attention layer's K/V in
one buffer [attention layers, 2, kv_heads, capacity, head_dim], every GDN layer's conv and recurrent state in
one tensor each. So a commit is a few operations for the whole model, not a few per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from remote_worker.cache.gdn_math import TreeDeltaResult, commit_state
from remote_worker.cache.tree import Tree
from remote_worker.cache.tree_context import TreeContext


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """GDN state and recurrence run in float32 (float64 for a float64 model), as the model's own kernels do."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] dims (partial rotary leaves the rest as they are)."""
    rotary = cos.shape[-1]
    rot, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


@dataclass
class GDNPending:
    """What commit needs from one GDN layer's verify."""

    extended: torch.Tensor  # [kernel-1+n, conv_dim] the conv state followed by the tree's pre-conv inputs
    keys: torch.Tensor  # [Hk, n, d_k] normalised keys, compute dtype
    result: TreeDeltaResult


class HybridCache:
    """The committed state of one sequence: K/V of the attention layers, conv and recurrent state of the GDN
    layers, and the committed length. Buffers are allocated at the first verify (their shapes come from the
    layers) and K/V grow by doubling unless `reserve` made room first."""

    def __init__(self, kinds: list[str]) -> None:
        self.kinds = list(kinds)
        self.attention_layers = kinds.count("attention")
        self.gdn_layers = kinds.count("gdn")
        self.kv: torch.Tensor | None = None  # [attention layers, 2, kv_heads, capacity, head_dim]
        self.conv: torch.Tensor | None = None  # [gdn layers, kernel-1, conv_dim]
        # [gdn layers, Hk, d_k, r, d_v], compute dtype: value heads grouped by the key head they read, laid
        # out so that one matmul per key head reads all r of them (see gdn_math.tree_delta_rule)
        self.recurrent: torch.Tensor | None = None
        self.pending: list[GDNPending | None] = [None] * self.gdn_layers
        self.length = 0
        self.capacity = 0  # tokens the K/V buffer should hold when it is allocated
        self.context: TreeContext | None = None

    def clone(self) -> HybridCache:
        """An independent copy of the committed state (not of a verified, uncommitted tree)."""
        copy = HybridCache(self.kinds)
        copy.kv = None if self.kv is None else self.kv.clone()
        copy.conv = None if self.conv is None else self.conv.clone()
        copy.recurrent = None if self.recurrent is None else self.recurrent.clone()
        copy.length, copy.capacity = self.length, self.capacity
        return copy

    def reserve(self, length: int) -> None:
        """Room for `length` tokens (committed and a tree's) in the K/V buffer, so that none grows while decoding."""
        self.capacity = max(self.capacity, length)
        if self.kv is not None and self.kv.shape[3] < length:
            self._grow(length)

    def _grow(self, needed: int) -> None:
        assert self.kv is not None
        grown = self.kv.new_zeros(*self.kv.shape[:3], max(needed, 2 * self.kv.shape[3]), self.kv.shape[4])
        grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.kv = grown

    def attention_buffer(self, slot: int, like: torch.Tensor, end: int) -> torch.Tensor:
        """Layer `slot`'s K/V buffer [2, kv_heads, capacity, head_dim], with room for `end` tokens.
        like: a key [kv_heads, n, head_dim] of this layer (gives the shape, dtype and device)."""
        if self.kv is None:
            capacity = max(end, self.capacity, 64)
            self.kv = like.new_zeros(self.attention_layers, 2, like.shape[0], capacity, like.shape[2])
        elif self.kv.shape[3] < end:
            self._grow(end)
        return self.kv[slot]

    def gdn_state(
        self, slot: int, conv_shape: tuple[int, int], recurrent_shape: tuple[int, int, int, int], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `slot`'s conv state [kernel-1, conv_dim] (like's dtype) and recurrent state, a view
        [Hk, r, d_k, d_v] (compute dtype; recurrent_shape gives (Hk, r, d_k, d_v)), zero before the first commit."""
        if self.conv is None or self.recurrent is None:
            hk, r, dk, dv = recurrent_shape
            self.conv = like.new_zeros(self.gdn_layers, *conv_shape)
            self.recurrent = like.new_zeros(self.gdn_layers, hk, dk, r, dv, dtype=compute_dtype(like.dtype))
        return self.conv[slot], self.recurrent[slot].transpose(1, 2)

    def begin(self, tree: Tree, device: torch.device, dtype: torch.dtype) -> TreeContext:
        self.context = TreeContext.build(tree, self.length, device, dtype, compute_dtype(dtype))
        return self.context

    def commit(self, path: list[int]) -> torch.Tensor:
        """Make the nodes of `path` (root first, each the parent of the next) the next committed tokens.
        Returns the path as a device tensor, for callers that gather the path's rows of something else."""
        ctx = self.context
        if ctx is None:
            raise RuntimeError("commit without a verified tree")
        parents = ctx.tree.parents.tolist()
        if path[0] != 0 or any(parents[b] != a for a, b in pairwise(path)):
            raise ValueError(f"{path} is not a root path of the verified tree")
        index = torch.tensor(path, device=ctx.tokens.device)  # the round's one host→device copy for the path
        if self.kv is not None:
            window = self.kv[:, :, :, ctx.committed : ctx.committed + ctx.size]
            window[:, :, :, : len(path)] = window[:, :, :, index]
        if self.gdn_layers and all(p is not None for p in self.pending):
            pending: list[GDNPending] = self.pending  # type: ignore[assignment]
            assert self.conv is not None and self.recurrent is not None
            stacked = TreeDeltaResult(
                out=torch.empty(0),
                u=torch.stack([p.result.u for p in pending]),  # [gdn layers, Hv, n, d_v]
                c=torch.stack([p.result.c for p in pending]),  # [gdn layers, Hv, n]
            )
            keys = torch.stack([p.keys for p in pending])  # [gdn layers, Hk, n, d_k]
            state = commit_state(self.recurrent.transpose(2, 3), keys, stacked, index, grouped=True)
            self.recurrent = state.transpose(2, 3).contiguous()
            windows = ctx.conv_windows(self.conv.shape[1] + 1)
            self.conv = torch.stack([p.extended for p in pending])[:, windows[path[-1], 1:]]
        self.pending = [None] * self.gdn_layers
        self.length += len(path)
        self.context = None
        return index
