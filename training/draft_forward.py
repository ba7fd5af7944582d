"""The DFlash draft's training forward: many blocks of one sequence in one pass, with gradients.

`DFlashDraft.propose` drafts one block at the end of a cached context; this computes what `propose` would
give for a block rooted at each anchor position c of a sequence, seeing the target features of positions
< c only (the bonus token at c has not been through the target yet, as in decoding). A test ties the two.
"""

from __future__ import annotations

import torch
from torch import nn

from remote_worker.cache.hybrid_cache import apply_rope
from remote_worker.models.dflash import DFlashDraft


def block_logits(
    draft: DFlashDraft,
    features: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    embed: nn.Embedding,
    head: nn.Module,
) -> torch.Tensor:
    """Logits [len(anchors), block_size-1, vocab] of the positions after each anchor.

    features: [n, len(target_layer_ids) * hidden] of the sequence's tokens; tokens: [n]; anchors: [k] with
    1 <= c and c + block_size - 1 < n is not required (labels are the caller's business)."""
    n, size, k = features.shape[0], draft.block_size, anchors.shape[0]
    projected = draft.hidden_norm(draft.fc(features))
    cos_ctx, sin_ctx = draft._rope(projected, 0, n)
    mask_embedding = embed(torch.tensor(draft.mask_token_id, device=tokens.device))
    block = torch.cat([embed(tokens[anchors])[:, None], mask_embedding.expand(k, size - 1, -1)], dim=1)
    positions = anchors[:, None] + torch.arange(size, device=tokens.device)[None]  # [k, size]
    cos_all, sin_all = draft.rotary_emb(block.reshape(1, k * size, -1), positions.reshape(1, -1))
    cos_blk, sin_blk = cos_all[0], sin_all[0]
    # Query (block j, slot s) at position anchor_j + s sees context keys < anchor j and keys of its own block,
    # each layer narrowing that by its rule (causal, window) exactly as `propose` does.
    query_pos = positions.reshape(-1)[:, None]  # [k*size, 1]
    context_pos = torch.arange(n, device=tokens.device)[None, :]
    own_block = torch.eye(k, dtype=torch.bool, device=tokens.device).repeat_interleave(size, 0)
    own_block = own_block.repeat_interleave(size, 1)  # [k*size, k*size]
    block_pos = positions.reshape(-1)[None, :]

    def visibility(causal: bool, window: int | None) -> torch.Tensor:
        sees_context = context_pos < anchors.repeat_interleave(size)[:, None]
        sees_block = own_block.clone()
        if causal:
            sees_block &= block_pos <= query_pos
        if window is not None:
            sees_context &= (query_pos - context_pos).abs() < window
            sees_block &= (query_pos - block_pos).abs() < window
        return torch.cat([sees_context, sees_block], dim=1)  # [k*size, n + k*size]

    h = block.reshape(k * size, -1)
    for layer in draft.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(x).view(k * size, attn.num_heads, attn.head_dim)).transpose(0, 1)
        q = apply_rope(q, cos_blk, sin_blk)
        ctx_k, ctx_v = attn.keys_values(projected, cos_ctx, sin_ctx)
        blk_k, blk_v = attn.keys_values(x, cos_blk, sin_blk)
        keys, values = torch.cat([ctx_k, blk_k], dim=1), torch.cat([ctx_v, blk_v], dim=1)
        groups = attn.num_heads // attn.num_kv_heads
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        scores = (q @ keys.transpose(1, 2)) * attn.scaling
        scores = scores.masked_fill(~visibility(attn.is_causal, attn.sliding_window)[None], float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1).reshape(k * size, -1)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = head(draft.norm(h)).view(k, size, -1)
    return logits[:, 1:]
