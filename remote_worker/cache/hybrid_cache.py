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


@dataclass(frozen=True)
class CacheLayout:
    """The shapes of a model's cache buffers, read off its layers (`TargetModel.layout`)."""

    device: torch.device
    dtype: torch.dtype
    attention: tuple[int, int] | None  # (kv_heads, head_dim)
    gdn: tuple[int, int, int, int, int, int] | None  # (kernel-1, conv_dim, Hk, r, d_k, d_v)


@dataclass
class GDNPending:
    """What commit needs from one GDN layer's verify."""

    extended: torch.Tensor  # [kernel-1+n, conv_dim] the conv state followed by the tree's pre-conv inputs
    keys: torch.Tensor  # [Hk, n, d_k] normalised keys, compute dtype
    result: TreeDeltaResult


class HybridCache:
    """The committed state of one sequence: K/V of the attention layers, conv and recurrent state of the GDN
    layers, and the committed length. Every buffer is allocated here, zero; the K/V buffer grows by doubling
    before a round that would overflow it (in `begin`, never inside the layers), unless `reserve` made room
    first. With no layout, nothing is allocated (`clone` fills the buffers in)."""

    def __init__(self, kinds: list[str], layout: CacheLayout | None = None, capacity: int = 64) -> None:
        self.kinds = list(kinds)
        self.attention_layers = kinds.count("attention")
        self.gdn_layers = kinds.count("gdn")
        self.kv: torch.Tensor | None = None  # [attention layers, 2, kv_heads, capacity, head_dim]
        self.conv: torch.Tensor | None = None  # [gdn layers, kernel-1, conv_dim]
        # [gdn layers, Hk, d_k, r, d_v], compute dtype: value heads grouped by the key head they read, laid
        # out so that one matmul per key head reads all r of them (see gdn_math.tree_delta_rule)
        self.recurrent: torch.Tensor | None = None
        if layout is not None and layout.attention is not None and self.attention_layers:
            kv_heads, head_dim = layout.attention
            shape = (self.attention_layers, 2, kv_heads, capacity, head_dim)
            self.kv = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        if layout is not None and layout.gdn is not None and self.gdn_layers:
            history, conv_dim, hk, r, dk, dv = layout.gdn
            self.conv = torch.zeros(self.gdn_layers, history, conv_dim, dtype=layout.dtype, device=layout.device)
            compute = compute_dtype(layout.dtype)
            self.recurrent = torch.zeros(self.gdn_layers, hk, dk, r, dv, dtype=compute, device=layout.device)
        self.pending: list[GDNPending | None] = [None] * self.gdn_layers
        self.length = 0
        # A fixed-shape decode keeps the committed length on the device instead (`begin_fixed`, `commit_fixed`).
        self.device_length: torch.Tensor | None = None
        self.context: TreeContext | None = None

    def clone(self) -> HybridCache:
        """An independent copy of the committed state (not of a verified, uncommitted tree)."""
        copy = HybridCache(self.kinds)
        copy.kv = None if self.kv is None else self.kv.clone()
        copy.conv = None if self.conv is None else self.conv.clone()
        copy.recurrent = None if self.recurrent is None else self.recurrent.clone()
        copy.length = self.length
        return copy

    def reserve(self, length: int) -> None:
        """Room for `length` tokens (committed and a tree's) in the K/V buffer, so that none grows while decoding."""
        if self.kv is not None and self.kv.shape[3] < length:
            self._grow(length)

    def _grow(self, needed: int) -> None:
        assert self.kv is not None
        grown = self.kv.new_zeros(*self.kv.shape[:3], max(needed, 2 * self.kv.shape[3]), self.kv.shape[4])
        grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.kv = grown

    def attention_buffer(self, slot: int) -> torch.Tensor:
        """Layer `slot`'s K/V buffer [2, kv_heads, capacity, head_dim] (a view)."""
        assert self.kv is not None
        return self.kv[slot]

    def gdn_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `slot`'s conv state [kernel-1, conv_dim] and recurrent state, a view [Hk, r, d_k, d_v]."""
        assert self.conv is not None and self.recurrent is not None
        return self.conv[slot], self.recurrent[slot].transpose(1, 2)

    def begin(self, tree: Tree, device: torch.device, dtype: torch.dtype) -> TreeContext:
        """A round starts: room for the tree past the committed tokens, and its context, built once."""
        self.reserve(self.length + tree.size)
        self.context = TreeContext.build(tree, self.length, device, dtype, compute_dtype(dtype))
        return self.context

    def load(self, other: HybridCache) -> None:
        """Copy `other`'s committed state into this cache's buffers, in place (their capacity stays): a
        fixed-shape decode starts every prompt from the same buffers, so a captured graph stays valid."""
        if self.kv is not None and other.kv is not None:
            if other.length > self.kv.shape[3]:
                raise ValueError(f"{other.length} committed tokens do not fit a cache of {self.kv.shape[3]}")
            self.kv[:, :, :, : other.length].copy_(other.kv[:, :, :, : other.length])
        if self.conv is not None and other.conv is not None and other.recurrent is not None:
            assert self.recurrent is not None
            self.conv.copy_(other.conv)
            self.recurrent.copy_(other.recurrent)
        self.length = other.length
        self.to_device_length().fill_(other.length)
        self.pending = [None] * self.gdn_layers
        self.context = None

    def clear(self) -> None:
        """Back to no committed tokens, in place (the K/V past the length are never read)."""
        if self.conv is not None and self.recurrent is not None:
            self.conv.zero_()
            self.recurrent.zero_()
        self.length = 0
        self.to_device_length().zero_()
        self.pending = [None] * self.gdn_layers
        self.context = None

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else int(self.kv.shape[3])

    def to_device_length(self) -> torch.Tensor:
        """Hand the committed length to the device, for fixed-shape rounds (one copy, before the first)."""
        if self.device_length is None:
            device = next(t.device for t in (self.kv, self.conv) if t is not None)
            self.device_length = torch.tensor(self.length, device=device)
        return self.device_length

    def begin_fixed(
        self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, depth: int, dtype: torch.dtype
    ) -> TreeContext:
        """`begin` for a tree on the device: nothing grows (reserve first) and no size depends on a device value."""
        length = self.to_device_length()
        capacity = max(self.capacity, 1)
        self.context = TreeContext.build_fixed(
            tokens, parents, depths, length, depth, capacity, dtype, compute_dtype(dtype)
        )
        return self.context

    def commit_fixed(self, path: torch.Tensor, count: torch.Tensor) -> None:
        """`commit` with the path on the device: `path` [L] holds the accepted nodes root first, its tail past
        `count` (a device scalar) repeating the last one. Every update is in place, so compiled rounds and
        CUDA graphs see the same buffers each time."""
        ctx, length = self.context, self.device_length
        if ctx is None or length is None:
            raise RuntimeError("commit_fixed without a verified fixed-shape tree")
        steps = torch.arange(path.shape[0], device=path.device)
        if self.kv is not None:  # the path's K/V to the front of the window (gathered first, then written)
            self.kv.index_copy_(3, length + steps, self.kv.index_select(3, length + path))
        if self.gdn_layers:
            pending: list[GDNPending] = self.pending  # type: ignore[assignment]
            assert self.conv is not None and self.recurrent is not None
            stacked = TreeDeltaResult(
                out=torch.empty(0),
                u=torch.stack([p.result.u for p in pending]),
                c=torch.stack([p.result.c for p in pending]),
            )
            keys = torch.stack([p.keys for p in pending])
            state = commit_state(self.recurrent.transpose(2, 3), keys, stacked, path, grouped=True, keep=steps < count)
            self.recurrent.copy_(state.transpose(2, 3))
            windows = ctx.conv_windows(self.conv.shape[1] + 1)
            last_window = windows[path[-1:], 1:][0]  # indexed by a 1-element tensor: no device value read
            self.conv.copy_(torch.stack([p.extended for p in pending])[:, last_window])
        length.add_(count)
        self.pending = [None] * self.gdn_layers
        self.context = None

    def commit(self, path: list[int]) -> torch.Tensor:
        """Make the nodes of `path` (root first, each the parent of the next) the next committed tokens.
        Returns the path as a device tensor, for callers that gather the path's rows of something else."""
        ctx = self.context
        if ctx is None or ctx.tree is None or ctx.committed is None:
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
