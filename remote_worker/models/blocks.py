"""The target's decoder layers as blocks that a compiled round traces once per kind, not once per layer.

Compiled as one graph, a round inlines every decoder layer, and dynamo and inductor trace, optimise and
generate code for each of them again: the compile time grows with the depth (about 1.3 s a layer here,
several minutes at 64 layers). Each block's `forward` is a `torch.compiler.nested_compile_region`
(hierarchical compilation, the idea of vLLM's piecewise compile): the first layer of a kind is traced and
compiled, and every later layer of the same kind and shapes calls that same compiled code with its own
weights and state as inputs. The round stays one graph (one CUDA graph on a GPU); eagerly the region is a
plain call, so the reference rounds run the very same code.

A region is reused only where its trace holds for the next layer as it is, so `forward` is a pure function of
its tensors: what differs between layers is reached through `self` (dynamo re-reads `self`'s attributes
for the next layer: its weights) and never as a Python number (a layer's slot in the cache, which would
be baked into the trace, is read outside, in `run`, where the layer's state views are picked); it returns
tensors only, and writes nothing but the state tensors it is handed (an attention layer's K/V buffer).
"""

from __future__ import annotations

import torch
from torch import nn

from remote_worker.cache.gdn_math import TreeDeltaResult
from remote_worker.cache.hybrid_cache import GDNPending, HybridCache
from remote_worker.cache.tree_context import TreeContext
from remote_worker.models.mixers import AttentionMixer, GDNMixer
from remote_worker.models.mlp import GatedMLP
from remote_worker.models.norms import FastRMSNorm


def owned(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A region's outputs, each in memory of its own. An output that is a view into an intermediate at an
    offset (the keys, a slice of q|k; a split of a fused projection) came back from a compiled region read
    from the intermediate's start (torch 2.13, inductor on a CPU: the committed GDN state blew up). The
    copies are of [n, ...] activations, never of a cache, and made only while compiling (eagerly the region
    is a plain call, and a view is as good as a copy)."""
    if not torch.compiler.is_compiling():
        return tensors
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in tensors)


class DecoderBlock(nn.Module):
    """One decoder layer: h + mixer(pre_norm(h)), then + mlp(post_norm(·)). `run` picks the layer's state out
    of the cache and calls the region (`forward`); subclasses are the layer kinds."""

    def __init__(self, mixer: AttentionMixer | GDNMixer, mlp: GatedMLP, norms: tuple[FastRMSNorm, FastRMSNorm]):
        super().__init__()
        self.mixer, self.mlp = mixer, mlp
        self.pre_norm, self.post_norm = norms

    def run(self, h: torch.Tensor, ctx: TreeContext, cache: HybridCache) -> torch.Tensor:
        raise NotImplementedError

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_norm(h))


class GDNBlock(DecoderBlock):
    mixer: GDNMixer

    def run(self, h: torch.Tensor, ctx: TreeContext, cache: HybridCache) -> torch.Tensor:
        """h [n, hidden] → [n, hidden]; what the layer's commit needs is left in `cache.pending`."""
        slot = self.mixer.slot
        conv_state, state = cache.gdn_state(slot)
        windows = ctx.conv_windows(self.mixer.kernel)
        h, extended, keys, u, c = self(h, conv_state, state, windows, ctx.mask, ctx.ancestors, ctx.decay_bias)
        cache.pending[slot] = GDNPending(extended=extended, keys=keys, result=TreeDeltaResult(h[:0], u, c))
        return h

    @torch.compiler.nested_compile_region
    def forward(
        self,
        h: torch.Tensor,
        conv_state: torch.Tensor,
        state: torch.Tensor,
        windows: torch.Tensor,
        mask: torch.Tensor,
        ancestors: torch.Tensor,
        decay_bias: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """(h out [n, hidden], extended inputs, keys, deltas u, decay sums c): see `GDNMixer`."""
        out, pending = self.mixer(self.pre_norm(h), conv_state, state, windows, mask, ancestors, decay_bias)
        h = self.feed_forward(h + out)
        return owned(h, pending.extended, pending.keys, pending.result.u, pending.result.c)


class AttentionBlock(DecoderBlock):
    """One region that writes the tree's K/V into the buffer it is handed and attends over it. Functionalised,
    the write costs copies of the layer's K/V buffer, as it did in the whole-round graph; split into two
    regions with the write and the attention in the round's graph between them, the round ran no faster
    and compiled 40 % slower at 64 layers (more of it is per layer)."""

    mixer: AttentionMixer

    def run(self, h: torch.Tensor, ctx: TreeContext, cache: HybridCache) -> torch.Tensor:
        """h [n, hidden] → [n, hidden]; the tree's K/V are written into the layer's cache buffer."""
        assert ctx.rope is not None
        buffer = cache.attention_buffer(self.mixer.slot)
        return self(h, buffer, *ctx.rope, ctx.attention_bias, ctx.slots, ctx.committed)

    @torch.compiler.nested_compile_region
    def forward(
        self,
        h: torch.Tensor,
        buffer: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        perm: torch.Tensor,
        attention_bias: torch.Tensor,
        slots: torch.Tensor | None,
        committed: int | None,
    ) -> torch.Tensor:
        """buffer: the layer's K/V [2, kv_heads, capacity, d]; the rest as in `AttentionMixer.__call__`."""
        out = self.mixer(self.pre_norm(h), buffer, (cos, sin, perm), attention_bias, slots, committed)
        return self.feed_forward(h + out)


def decoder_block(
    mixer: AttentionMixer | GDNMixer, mlp: GatedMLP, norms: tuple[FastRMSNorm, FastRMSNorm]
) -> DecoderBlock:
    kind = GDNBlock if isinstance(mixer, GDNMixer) else AttentionBlock
    return kind(mixer, mlp, norms)
