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
from remote_worker.cache.hybrid_cache import GDNPending, HybridCache, compute_dtype
from remote_worker.cache.tree_context import TreeContext
from remote_worker.models.fusion import FusedLinear
from remote_worker.models.norms import FastRMSNorm


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Rotary embedding as x·cos + x[perm]·sin over the whole head (built once per round).

    cos, sin: [n, rotary] from the model's rotary module. rotate_half(x) is x permuted with the first half's
    sign flipped, so the sign goes into sin; dims past `rotary` (partial rotary) get cos 1 and sin 0, which
    leaves them as they are. Returns cos [n, 1, head_dim], signed sin [n, 1, head_dim], perm [head_dim]."""
    n, rotary = cos.shape
    half, rest = rotary // 2, head_dim - rotary
    full_cos = torch.cat([cos, cos.new_ones(n, rest)], dim=-1)
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:], sin.new_zeros(n, rest)], dim=-1)
    index = torch.arange(head_dim, device=cos.device)
    perm = torch.where(index < half, index + half, torch.where(index < rotary, index - half, index))
    return full_cos[:, None], signed_sin[:, None], perm


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
        self.q_norm, self.k_norm = FastRMSNorm(module.q_norm), FastRMSNorm(module.k_norm)
        self.qkv = FusedLinear(module.q_proj, module.k_proj, module.v_proj)

    def __call__(self, x: torch.Tensor, ctx: TreeContext, cache: HybridCache) -> torch.Tensor:
        """x: [n, hidden] → [n, hidden]."""
        module, n, d = self.module, x.shape[0], self.head_dim
        projected, key, value = self.qkv(x)
        gate = None
        if projected.shape[-1] == 2 * self.heads * d:  # gated attention (Qwen3.5, Qwen3-Next)
            query, gate = torch.chunk(projected.view(n, self.heads, 2 * d), 2, dim=-1)
            gate = gate.reshape(n, -1)
        else:
            query = projected.view(n, self.heads, d)
        assert ctx.rope is not None
        query = rope(self.q_norm(query), ctx.rope)  # [n, heads, d]
        key = rope(self.k_norm(key.view(n, -1, d)), ctx.rope)  # [n, kv_heads, d]
        start, end = ctx.committed, ctx.committed + n
        buffer = cache.attention_buffer(self.slot, key.transpose(0, 1), end)  # [2, kv_heads, capacity, d]
        buffer[0, :, start:end] = key.transpose(0, 1)
        buffer[1, :, start:end] = value.view(n, -1, d).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            buffer[None, 0, :, :end],
            buffer[None, 1, :, :end],
            attn_mask=ctx.attention_bias,
            scale=module.scaling,
            enable_gqa=True,
        )  # [1, heads, n, d]
        out = out[0].transpose(0, 1).reshape(n, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return module.o_proj(out)


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

    def __call__(self, x: torch.Tensor, ctx: TreeContext, cache: HybridCache) -> torch.Tensor:
        module, n, cd = self.module, x.shape[0], self.compute
        hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
        inputs, z, b, a = self._projections(x)
        conv_state, state = cache.gdn_state(
            self.slot, (self.kernel - 1, inputs.shape[1]), (hk, hv // hk, dk, dv), inputs
        )
        mixed, extended = tree_conv(inputs, conv_state, self.conv_weight, self.conv_bias, ctx.conv_windows(self.kernel))
        qk = l2norm(mixed[:, : 2 * module.key_dim].unflatten(-1, (2 * hk, dk)).to(cd))  # [n, 2·Hk, d_k]
        query = (qk[:, :hk] * self.scale).transpose(0, 1)  # [Hk, n, d_k]
        key = qk[:, hk:].transpose(0, 1)
        value = mixed[:, 2 * module.key_dim :].unflatten(-1, (hv, dv)).to(cd).transpose(0, 1)  # [Hv, n, d_v]
        beta = b.to(cd).sigmoid().t()  # [Hv, n]
        g = (self.neg_rate * F.softplus(a.to(cd) + self.dt_bias)).t()
        result = tree_delta_rule(query, key, value, g, beta, state, ctx.mask, ctx.ancestors, ctx.decay_bias)
        cache.pending[self.slot] = GDNPending(extended=extended, keys=key, result=result)
        out = result.out.transpose(0, 1).to(x.dtype)  # [n, Hv, d_v]
        out = module.norm(out.reshape(-1, dv), z.reshape(-1, dv))
        return module.out_proj(out.reshape(n, -1))
