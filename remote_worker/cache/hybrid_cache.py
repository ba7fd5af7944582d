"""One cache for AR, DFlash and DDTree on hybrid and dense models.

`verify` runs a tree's nodes through a layer without touching the committed state: full-attention layers
write the tree's K/V into the window just past the committed length, Gated DeltaNet layers keep what commit
needs (pre-conv inputs, keys, deltas, decay sums). `commit(path)` then makes the accepted path part of the
committed state, once, with no re-run: K/V of the path are compacted to the front of the window, the GDN
recurrent state is advanced in closed form and its conv state becomes the path's last inputs. A rejected
branch therefore costs nothing to roll back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remote_worker.cache.gdn_math import (
    TreeDeltaResult,
    commit_conv_state,
    commit_state,
    conv_windows,
    tree_conv,
    tree_delta_rule,
)
from remote_worker.cache.tree import Tree


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """GDN state and recurrence run in float32 (float64 for a float64 model), as the model's own kernels do."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class TreeContext:
    """What every layer needs to know about the tree being verified."""

    tree: Tree
    committed: int
    mask: torch.Tensor  # [n, n] ancestor-or-self, on the model's device
    attention_bias: torch.Tensor  # [n, committed + n] 0 where visible, -inf elsewhere
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # conv kernel -> [n, kernel] gather indices

    @staticmethod
    def build(tree: Tree, committed: int, device: torch.device, dtype: torch.dtype) -> TreeContext:
        mask = tree.ancestor_mask().to(device)
        bias = torch.zeros(tree.size, committed + tree.size, dtype=dtype, device=device)
        bias[:, committed:] = torch.where(mask, 0.0, float("-inf"))
        return TreeContext(tree=tree, committed=committed, mask=mask, attention_bias=bias)

    def conv_windows(self, kernel: int) -> torch.Tensor:
        if kernel not in self.windows:
            self.windows[kernel] = conv_windows(self.tree.parents, kernel)
        return self.windows[kernel]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As the model's kernels normalise q and k: x / sqrt(|x|² + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] dims (partial rotary leaves the rest as they are)."""
    rotary = cos.shape[-1]
    rot, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


class AttentionLayerCache:
    """K/V of the committed tokens, in a buffer that grows by doubling; the tree's K/V go just past them."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None

    def clone(self) -> AttentionLayerCache:
        copy = AttentionLayerCache()
        if self.keys is not None and self.values is not None:
            copy.keys, copy.values = self.keys.clone(), self.values.clone()
        return copy

    def reserve(self, needed: int) -> None:
        if self.keys is not None:
            self._reserve(needed, self.keys)

    def _reserve(self, needed: int, like: torch.Tensor) -> None:
        if self.keys is not None and self.keys.shape[1] >= needed:
            return
        capacity = max(needed, 2 * (self.keys.shape[1] if self.keys is not None else 64))
        keys = like.new_zeros(like.shape[0], capacity, like.shape[2])
        values = like.new_zeros(like.shape[0], capacity, like.shape[2])
        if self.keys is not None and self.values is not None:
            keys[:, : self.keys.shape[1]] = self.keys
            values[:, : self.values.shape[1]] = self.values
        self.keys, self.values = keys, values

    def forward(
        self, module: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: TreeContext
    ) -> torch.Tensor:
        """x: [n, hidden] → [n, hidden]; every node attends to the committed tokens and its own ancestors."""
        n, head_dim = x.shape[0], module.head_dim
        projected = module.q_proj(x)
        heads = module.config.num_attention_heads
        gate = None
        if projected.shape[-1] == 2 * heads * head_dim:  # gated attention (Qwen3.5, Qwen3-Next)
            query, gate = torch.chunk(projected.view(n, heads, 2 * head_dim), 2, dim=-1)
            gate = gate.reshape(n, -1)
        else:
            query = projected.view(n, heads, head_dim)
        query = module.q_norm(query).transpose(0, 1)  # [heads, n, d]
        key = module.k_norm(module.k_proj(x).view(n, -1, head_dim)).transpose(0, 1)
        value = module.v_proj(x).view(n, -1, head_dim).transpose(0, 1)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        start, end = ctx.committed, ctx.committed + n
        self._reserve(end, key)
        assert self.keys is not None and self.values is not None
        self.keys[:, start:end] = key
        self.values[:, start:end] = value
        groups = heads // key.shape[0]
        keys = self.keys[:, :end].repeat_interleave(groups, dim=0)
        values = self.values[:, :end].repeat_interleave(groups, dim=0)
        scores = (query @ keys.transpose(1, 2)) * module.scaling + ctx.attention_bias
        weights = torch.softmax(scores, dim=-1, dtype=compute_dtype(query.dtype)).to(query.dtype)
        out = (weights @ values).transpose(0, 1).reshape(n, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return module.o_proj(out)

    def commit(self, ctx: TreeContext, path: list[int], index: torch.Tensor) -> None:
        assert self.keys is not None and self.values is not None
        start = ctx.committed
        rows = index + start
        self.keys[:, start : start + len(path)] = self.keys[:, rows]
        self.values[:, start : start + len(path)] = self.values[:, rows]


@dataclass
class _GDNPending:
    extended: torch.Tensor  # [kernel-1+n, conv_dim] the conv state followed by the tree's pre-conv inputs
    keys: torch.Tensor  # [heads, n, d_k] normalised keys, compute dtype
    result: TreeDeltaResult


class GDNLayerCache:
    """Conv state (last kernel-1 inputs) and recurrent state of one Gated DeltaNet layer, and its tree forward.

    The forward reuses the module's parameters but not its `forward`, which differs between transformers
    releases and in some of them drops the recurrent state on multi-token cached calls.
    """

    def __init__(self) -> None:
        self.conv: torch.Tensor | None = None  # [kernel-1, conv_dim]
        self.recurrent: torch.Tensor | None = None  # [v_heads, d_k, d_v], compute dtype
        self._pending: _GDNPending | None = None

    def clone(self) -> GDNLayerCache:
        copy = GDNLayerCache()
        if self.conv is not None and self.recurrent is not None:
            copy.conv, copy.recurrent = self.conv.clone(), self.recurrent.clone()
        return copy

    def reserve(self, needed: int) -> None:
        """Nothing to do: a GDN layer's state has the same size at every length."""

    @staticmethod
    def _projections(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(pre-conv q|k|v inputs [n, conv_dim], z [n, v_heads, d_v], b [n, v_heads], a [n, v_heads])."""
        n = x.shape[0]
        if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: fused projections, interleaved per key head
            q, k, v, z, b, a = module.fix_query_key_value_ordering(
                module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None])
            )
            inputs = torch.cat([t.reshape(n, -1) for t in (q, k, v)], dim=-1)
            return inputs, z[0], b[0], a[0]
        z = module.in_proj_z(x).reshape(n, -1, module.head_v_dim)
        return module.in_proj_qkv(x), z, module.in_proj_b(x), module.in_proj_a(x)

    def forward(self, module: nn.Module, x: torch.Tensor, ctx: TreeContext) -> torch.Tensor:
        n = x.shape[0]
        kernel = module.conv_kernel_size
        cd = compute_dtype(x.dtype)
        inputs, z, b, a = self._projections(module, x)
        if self.conv is None or self.recurrent is None:
            self.conv = inputs.new_zeros(kernel - 1, inputs.shape[1])
            self.recurrent = x.new_zeros(module.num_v_heads, module.head_k_dim, module.head_v_dim, dtype=cd)
        windows = ctx.conv_windows(kernel)
        mixed, extended = tree_conv(inputs, self.conv, module.conv1d.weight[:, 0, :], module.conv1d.bias, windows)
        query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        repeat = module.num_v_heads // module.num_k_heads
        query = query.reshape(n, module.num_k_heads, -1).to(cd)
        key = key.reshape(n, module.num_k_heads, -1).to(cd)
        query, key = _l2norm(query), _l2norm(key)
        query = query.repeat_interleave(repeat, dim=1).transpose(0, 1) / module.head_k_dim**0.5
        key = key.repeat_interleave(repeat, dim=1).transpose(0, 1)
        value = value.reshape(n, module.num_v_heads, -1).to(cd).transpose(0, 1)
        beta = b.to(cd).sigmoid().t()
        g = (-module.A_log.to(cd).exp() * F.softplus(a.to(cd) + module.dt_bias.to(cd))).t()
        result = tree_delta_rule(query, key, value, g, beta, self.recurrent, ctx.mask)
        self._pending = _GDNPending(extended=extended, keys=key, result=result)
        out = result.out.transpose(0, 1).to(x.dtype)  # [n, v_heads, d_v]
        out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(out.reshape(n, -1))

    def commit(self, ctx: TreeContext, path: list[int], index: torch.Tensor) -> None:
        pending = self._pending
        assert pending is not None and self.conv is not None and self.recurrent is not None
        self.recurrent = commit_state(self.recurrent, pending.keys, pending.result, index)
        self.conv = commit_conv_state(pending.extended, ctx.conv_windows(self.conv.shape[0] + 1), path[-1])
        self._pending = None


LayerCache = AttentionLayerCache | GDNLayerCache


class HybridCache:
    """The per-layer caches of one sequence and its committed length."""

    def __init__(self, kinds: list[str]) -> None:
        self.layers: list[Any] = [GDNLayerCache() if kind == "gdn" else AttentionLayerCache() for kind in kinds]
        self.length = 0
        self.context: TreeContext | None = None

    def clone(self) -> HybridCache:
        """An independent copy of the committed state (not of a verified, uncommitted tree)."""
        copy = HybridCache([])
        copy.layers = [layer.clone() for layer in self.layers]
        copy.length = self.length
        return copy

    def reserve(self, length: int) -> None:
        """Room for `length` tokens (committed and a tree's) in every K/V buffer, so that no buffer grows
        while decoding."""
        for layer in self.layers:
            layer.reserve(length)

    def begin(self, tree: Tree, device: torch.device, dtype: torch.dtype) -> TreeContext:
        self.context = TreeContext.build(tree, self.length, device, dtype)
        return self.context

    def commit(self, path: list[int]) -> None:
        """Make the nodes of `path` (root first, each the parent of the next) the next committed tokens."""
        ctx = self.context
        if ctx is None:
            raise RuntimeError("commit without a verified tree")
        parents = ctx.tree.parents.tolist()
        if path[0] != 0 or any(parents[b] != a for a, b in pairwise(path)):
            raise ValueError(f"{path} is not a root path of the verified tree")
        index = torch.as_tensor(path, device=ctx.mask.device)
        for layer in self.layers:
            layer.commit(ctx, path, index)
        self.length += len(path)
        self.context = None
