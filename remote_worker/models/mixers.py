"""The token mixers of a target model run over a tree through the hybrid cache.

Each mixer reuses its module's parameters but not its `forward`, which differs between transformers
releases and in some of them drops the recurrent state on multi-token cached calls. Everything they need
about the tree comes from the round's `TreeContext`, already on the device; they move nothing between host
and device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remote_worker.cache.gdn_math import tree_conv, tree_delta_rule
from remote_worker.cache.hybrid_cache import GDNPending, compute_dtype
from remote_worker.models.fusion import FusedLinear
from remote_worker.models.norms import FastGatedRMSNorm, FastRMSNorm, cast


class RotaryTables:
    """Rotary embedding as x·cos + x[perm]·sin over the whole head, for every position up to a capacity.

    The model's rotary module computes cos and sin [positions, rotary] once (so the values are its own: each
    position's angle is one product, whatever else is in the batch); a round then indexes them. rotate_half(x)
    is x permuted with the first half's sign flipped, so the sign goes into sin; dims past `rotary` (partial
    rotary) get cos 1 and sin 0, which leaves them as they are. The capacity doubles when a round passes it."""

    def __init__(self, rotary: nn.Module, head_dim: int) -> None:
        self.rotary, self.head_dim = rotary, head_dim
        self.cos: torch.Tensor | None = None  # [capacity, head_dim]
        self.sin: torch.Tensor | None = None  # [capacity, head_dim], signed
        self.perm: torch.Tensor | None = None  # [head_dim]

    def _build(self, capacity: int, like: torch.Tensor) -> None:
        positions = torch.arange(capacity, device=like.device)
        cos, sin = (t[0] for t in self.rotary(like[None, :1], positions[None]))
        rotary = cos.shape[-1]
        half, rest = rotary // 2, self.head_dim - rotary
        self.cos = torch.cat([cos, cos.new_ones(capacity, rest)], dim=-1)
        self.sin = torch.cat([-sin[:, :half], sin[:, half:], sin.new_zeros(capacity, rest)], dim=-1)
        index = torch.arange(self.head_dim, device=like.device)
        self.perm = torch.where(index < half, index + half, torch.where(index < rotary, index - half, index))

    def reserve(self, end: int, like: torch.Tensor) -> None:
        """Tables for every position below `end`, built now: a compiled round must find them built, since
        building them inside it would change what its next call sees (and compile it again)."""
        if self.cos is None or self.cos.shape[0] < end:
            self._build(max(end, 2 * (0 if self.cos is None else self.cos.shape[0]), 256), like)

    def __call__(self, positions: torch.Tensor, end: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tables for `positions` [n] (all below `end`, known on the host): cos, signed sin [n, 1, head_dim]
        and the permutation [head_dim]. like: a tensor of the model's dtype and device."""
        self.reserve(end, like)
        assert self.cos is not None and self.sin is not None and self.perm is not None
        return self.cos[positions][:, None], self.sin[positions][:, None], self.perm


def rope(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x: [n, heads, head_dim]; the same arithmetic as the model's (x·cos + rotate_half(x)·sin)."""
    cos, sin, perm = tables
    return torch.addcmul(x * cos, x.index_select(-1, perm), sin)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As the model's kernels normalise q and k: x / sqrt(|x|² + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class AttentionMixer:
    """Full (optionally gated) attention: every node reads the committed tokens and its own ancestors."""

    def __init__(self, module: nn.Module, slot: int) -> None:
        self.module, self.slot = module, slot
        self.heads = module.config.num_attention_heads
        self.head_dim = module.head_dim
        self.kv_heads = module.config.num_key_value_heads
        self.q_norm, self.k_norm = FastRMSNorm(module.q_norm), FastRMSNorm(module.k_norm)
        self.qkv = FusedLinear(module.q_proj, module.k_proj, module.v_proj)
        self.o_proj = FusedLinear(module.o_proj)
        self.scaling = module.scaling

    def project(
        self, x: torch.Tensor, rope_tables: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: [n, hidden] → query [n, heads, d], key and value [kv_heads, n, d], and the output gate [n, heads·d]
        (None for ungated attention), normed and rotated."""
        n, d = x.shape[0], self.head_dim
        projected, key, value = self.qkv(x)
        gate = None
        if projected.shape[-1] == 2 * self.heads * d:  # gated attention (Qwen3.5, Qwen3-Next)
            query, gate = torch.chunk(projected.view(n, self.heads, 2 * d), 2, dim=-1)
            gate = gate.reshape(n, -1)
        else:
            query = projected.view(n, self.heads, d)
        query = rope(self.q_norm(query), rope_tables)  # [n, heads, d]
        key = rope(self.k_norm(key.view(n, -1, d)), rope_tables)  # [n, kv_heads, d]
        return query, key.transpose(0, 1), value.view(n, -1, d).transpose(0, 1), gate

    @staticmethod
    def write(
        buffer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor | None, committed: int | None
    ) -> int:
        """The tree's K/V [kv_heads, n, d] into this layer's buffer [2, kv_heads, capacity, d], in place: just
        past the `committed` tokens, or (a fixed-shape round) to `slots` [n], chosen on the device. Returns
        how many of the buffer's positions attention reads: up to the tree, or (fixed shapes) all, masked."""
        if slots is None:
            assert committed is not None
            end = committed + key.shape[1]
            buffer[0, :, committed:end] = key
            buffer[1, :, committed:end] = value
            return end
        buffer[0].index_copy_(1, slots, key)
        buffer[1].index_copy_(1, slots, value)
        return buffer.shape[2]

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention_bias: torch.Tensor
    ) -> torch.Tensor:
        """query [n, heads, d] over keys, values [kv_heads, positions, d] → [n, heads·d]."""
        n = query.shape[0]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], keys[None], values[None], attn_mask=attention_bias, scale=self.scaling,
            enable_gqa=True,
        )[0]  # fmt: skip
        return out.transpose(0, 1).reshape(n, -1)

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention's output [n, heads·d], gated (None: ungated) and projected → [n, hidden]."""
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)[0]

    def __call__(
        self,
        x: torch.Tensor,
        buffer: torch.Tensor,
        rope_tables: tuple[torch.Tensor, ...],
        attention_bias: torch.Tensor,
        slots: torch.Tensor | None,
        committed: int | None,
    ) -> torch.Tensor:
        """x: [n, hidden] → [n, hidden], the tree's K/V written into this layer's buffer (`write`) on the way."""
        query, key, value, gate = self.project(x, rope_tables)
        end = self.write(buffer, key, value, slots, committed)
        return self.output(self.attend(query, buffer[0, :, :end], buffer[1, :, :end], attention_bias), gate)


class GDNMixer:
    """Gated DeltaNet over a tree (see `remote_worker.cache.gdn_math`), with its per-layer constants
    (decay rates, conv weights) converted once."""

    def __init__(self, module: nn.Module, slot: int, dtype: torch.dtype) -> None:
        self.module, self.slot = module, slot
        compute = compute_dtype(dtype)
        self.compute = compute
        self.neg_rate = -module.A_log.detach().to(compute).exp()  # g = -exp(A_log)·softplus(a + dt_bias)
        self.dt_bias = module.dt_bias.detach().to(compute)
        self.conv_weight = module.conv1d.weight.detach()[:, 0, :]  # [conv_dim, kernel]
        self.conv_bias = None if module.conv1d.bias is None else module.conv1d.bias.detach()
        self.kernel = module.conv_kernel_size
        self.scale = module.head_k_dim**-0.5
        self.heads = (module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)
        hk, hv, dk, dv = self.heads
        # (kernel-1, conv_dim, Hk, r, d_k, d_v): the shapes of this layer's conv and recurrent state
        self.state_shape = (self.kernel - 1, module.conv1d.weight.shape[0], hk, hv // hk, dk, dv)
        self.key_dim = module.key_dim
        self.norm = FastGatedRMSNorm(module.norm)
        self.out_proj = FusedLinear(module.out_proj)
        if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next
            self.projections = FusedLinear(module.in_proj_qkvz, module.in_proj_ba)
        else:
            self.projections = FusedLinear(module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(pre-conv q|k|v inputs [n, conv_dim], z [n, v_heads, d_v], b [n, v_heads], a [n, v_heads])."""
        module, n = self.module, x.shape[0]
        if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: q|k|v|z and b|a interleaved per key head
            qkvz, ba = self.projections(x)
            q, k, v, z, b, a = module.fix_query_key_value_ordering(qkvz[None], ba[None])
            inputs = torch.cat([t.reshape(n, -1) for t in (q, k, v)], dim=-1)
            return inputs, z[0], b[0], a[0]
        inputs, z, b, a = self.projections(x)
        return inputs, z.reshape(n, -1, module.head_v_dim), b, a

    def __call__(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        state: torch.Tensor,
        windows: torch.Tensor,
        mask: torch.Tensor,
        ancestors: torch.Tensor,
        decay_bias: torch.Tensor,
    ) -> tuple[torch.Tensor, GDNPending]:
        """x: [n, hidden] → ([n, hidden], what commit needs). conv_state [kernel-1, conv_dim] and state
        [Hk, r, d_k, d_v] are this layer's committed state, read only; windows [n, kernel] and the masks are
        the round's (`TreeContext`). A pure function of tensors: a compiled round traces it once (`blocks`)."""
        n, cd = x.shape[0], self.compute
        hk, hv, dk, dv = self.heads
        inputs, z, b, a = self._projections(x)
        mixed, extended = tree_conv(inputs, conv_state, self.conv_weight, self.conv_bias, windows)
        qk = l2norm(cast(mixed[:, : 2 * self.key_dim].unflatten(-1, (2 * hk, dk)), cd))  # [n, 2·Hk, d_k]
        query = (qk[:, :hk] * self.scale).transpose(0, 1)  # [Hk, n, d_k]
        key = qk[:, hk:].transpose(0, 1)
        value = cast(mixed[:, 2 * self.key_dim :].unflatten(-1, (hv, dv)), cd).transpose(0, 1)  # [Hv, n, d_v]
        beta = cast(b, cd).sigmoid().t()  # [Hv, n]
        g = (self.neg_rate * F.softplus(cast(a, cd) + self.dt_bias)).t()
        result = tree_delta_rule(query, key, value, g, beta, state, mask, ancestors, decay_bias)
        out = cast(result.out.transpose(0, 1), x.dtype)  # [n, Hv, d_v]
        out = self.norm(out.reshape(-1, dv), z.reshape(-1, dv))
        return self.out_proj(out.reshape(n, -1))[0], GDNPending(extended=extended, keys=key, result=result)
