"""The DFlash block-diffusion drafter.

A few Qwen3-style decoder layers whose attention reads two things: the projected hidden states of chosen
target layers for every committed token (the context, kept in a `DraftContext`), and the block being
drafted — the last bonus token followed by mask tokens. The target's embedding and head are shared. One
forward drafts a whole block: logits for each of the block_size-1 positions after the root.

Each layer follows the published drafts' rule for what a query at position p sees (the context holds
positions 0..c-1, the block c..c+block_size-1):

- causal: keys at positions <= p only; a layer is causal when the config's top-level `is_causal` says so,
  else when it is a `sliding_attention` layer (full-attention layers see the whole block);
- windowed (`sliding_attention` with a `sliding_window` w, as Qwen3Config resolves it): keys with
  |p - k| < w only. Such a layer reads only the last w-1 context keys; it never builds the whole context.

Weights load from a DFlash checkpoint directory (config.json with `dflash_config`; `block_size` inside
`dflash_config`, else at the top level; safetensors weights named as in the published drafts), or are
built from a tiny config with a seed. `dflash_config` entries of other drafter variants (an input
embedding scale, a logit soft-cap, a convolution or selector) are refused rather than ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from remote_worker.cache.hybrid_cache import apply_rope, compute_dtype


def layer_rules(config: Qwen3Config) -> list[tuple[bool, int | None]]:
    """(is_causal, sliding_window or None) of each draft layer, by the published rule (see the module doc)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    forced = getattr(config, "is_causal", None)
    rules = []
    for layer_type in layer_types[: config.num_hidden_layers]:
        sliding = layer_type == "sliding_attention"
        causal = bool(forced) if forced is not None else sliding
        rules.append((causal, config.sliding_window if sliding and config.sliding_window else None))
    return rules


def block_visibility(
    context_length: int, first_key: int, block: int, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """visible[i, j]: may the block's query i (position context_length + i) read key j (position first_key + j)?

    Keys are the context from `first_key` on, then the block. None when every key is visible, which is
    decided here on the host (no device value is read)."""
    widest = context_length + block - 1 - first_key  # the largest |query - key|
    if (not causal or block == 1) and (window is None or widest < window):
        return None
    query = context_length + torch.arange(block, device=device)[:, None]
    key = first_key + torch.arange(context_length - first_key + block, device=device)[None, :]
    visible = torch.ones(block, key.shape[1], dtype=torch.bool, device=device)
    if causal:
        visible &= key <= query
    if window is not None:
        visible &= (query - key).abs() < window
    return visible


# dflash_config keys of other drafter variants: harmless at these values, anything else changes the draft.
_NEUTRAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
_OTHER_VARIANTS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def unsupported_dflash_keys(dflash: dict[str, Any]) -> list[str]:
    """`dflash_config` entries that would make this drafter compute something other than the checkpoint's."""
    keys = [f"{k}={dflash[k]!r}" for k, neutral in _NEUTRAL.items() if k in dflash and dflash[k] != neutral]
    return keys + [f"{k}={dflash[k]!r}" for k in _OTHER_VARIANTS if k in dflash]


class DraftContext:
    """One sequence's drafter state: every layer's K/V of the committed tokens (their projected target
    features), in one pre-allocated buffer [layers, 2, kv_heads, capacity, head_dim] that grows by doubling.
    A proposal writes its block's K/V just past the committed ones and attends there in place: nothing is
    concatenated per round, and the next `extend` overwrites the block's slots.

    `clone` gives an independent copy, so one prompt's context serves every method that decodes it."""

    def __init__(self, buffer: torch.Tensor, length: int = 0) -> None:
        self.buffer = buffer
        self.length = length
        self.device_length: torch.Tensor | None = None  # fixed-shape rounds keep the length on the device

    def to_device_length(self) -> torch.Tensor:
        if self.device_length is None:
            self.device_length = torch.tensor(self.length, device=self.buffer.device)
        return self.device_length

    def reserve(self, needed: int) -> None:
        capacity = self.buffer.shape[3]
        if needed <= capacity:
            return
        grown = self.buffer.new_zeros(*self.buffer.shape[:3], max(needed, 2 * capacity), self.buffer.shape[4])
        grown[:, :, :, : self.length] = self.buffer[:, :, :, : self.length]
        self.buffer = grown

    def load(self, other: DraftContext) -> None:
        """Copy `other`'s committed K/V into this buffer, in place (see `HybridCache.load`)."""
        if other.length + 1 > self.buffer.shape[3]:
            raise ValueError(f"a drafter context of {other.length} tokens does not fit {self.buffer.shape[3]}")
        self.buffer[:, :, :, : other.length].copy_(other.buffer[:, :, :, : other.length])
        self.length = other.length
        self.to_device_length().fill_(other.length)

    def clone(self) -> DraftContext:
        copy = self.buffer.new_zeros(self.buffer.shape)
        copy[:, :, :, : self.length] = self.buffer[:, :, :, : self.length]
        return DraftContext(copy, self.length)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.is_causal, self.sliding_window = layer_rules(config)[layer_idx]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        key = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        value = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(key, cos, sin), value

    def forward_fixed(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """`forward` with the committed length on the device: the block's K/V go to `slots` [B] (its
        positions), and attention reads the whole buffer under the same visibility rule as a mask."""
        n = x.shape[0]
        query = apply_rope(self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim)).transpose(0, 1), cos, sin)
        keys, values = self.keys_values(x, cos, sin)
        buffer[0].index_copy_(1, slots, keys)
        buffer[1].index_copy_(1, slots, values)
        key_position = torch.arange(buffer.shape[2], device=x.device)[None, :]
        query_position = slots[:, None]
        visible = key_position <= slots[-1]  # the context and the block; later slots hold stale keys
        if self.is_causal:
            visible = visible & (key_position <= query_position)
        if self.sliding_window is not None:
            visible = visible & ((query_position - key_position).abs() < self.sliding_window)
        out = F.scaled_dot_product_attention(
            query[None], buffer[None, 0], buffer[None, 1], attn_mask=visible, scale=self.scaling, enable_gqa=True
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buffer: torch.Tensor, committed: int):
        """x: the block [B, hidden]; buffer: this layer's [2, kv_heads, capacity, head_dim], the committed
        tokens' K/V in its first `committed` slots, room for the block after them → [B, hidden]."""
        n = x.shape[0]
        query = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim)).transpose(0, 1)
        query = apply_rope(query, cos, sin)
        buffer[0, :, committed : committed + n], buffer[1, :, committed : committed + n] = self.keys_values(x, cos, sin)
        # A window reaches back w-1 positions from the block's first query: older keys are never read.
        first = 0 if self.sliding_window is None else max(0, committed - self.sliding_window + 1)
        visible = block_visibility(committed, first, n, self.is_causal, self.sliding_window, x.device)
        out = F.scaled_dot_product_attention(
            query[None],
            buffer[None, 0, :, first : committed + n],
            buffer[None, 1, :, first : committed + n],
            attn_mask=visible,
            scale=self.scaling,
            enable_gqa=True,
        )  # [1, heads, B, head_dim]
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @torch.compiler.nested_compile_region
    def forward_fixed(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """The block h [B, hidden] through the layer, its K/V written to `slots` of `buffer` (this layer's).
        A compiled region (`remote_worker.models.blocks`): traced once per kind of layer (causal, windowed)."""
        h = h + self.self_attn.forward_fixed(self.input_layernorm(h), cos, sin, buffer, slots)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The drafter's weights; a sequence's state lives in a `DraftContext` (`new_context`)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        dflash = dict(getattr(config, "dflash_config", None) or {})
        if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
            raise ValueError("a DFlash config needs dflash_config.target_layer_ids and dflash_config.mask_token_id")
        unsupported = unsupported_dflash_keys(dflash)
        if unsupported:
            raise ValueError(
                f"draft config sets dflash_config {', '.join(unsupported)}, which this worker does not implement "
                "(a newer drafter variant?)"
            )
        block_size = dflash.get("block_size") or getattr(config, "block_size", None)
        if not block_size:
            raise ValueError("a DFlash config needs block_size (at the top level or in dflash_config)")
        self.config = config
        self.block_size = int(block_size)
        self.target_layer_ids = tuple(int(i) for i in dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target hidden-state indices (0 = embeddings) the drafter reads: the outputs of its target layers."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def cast(self, device: torch.device, dtype: torch.dtype) -> DFlashDraft:
        """Weights to `dtype` on `device`; the rotary frequencies stay in float32, as a checkpoint loaded by
        transformers keeps them (cast to bfloat16 they would shift every position's rotation)."""
        self.to(device=device, dtype=dtype)
        with torch.device(device):
            self.rotary_emb = Qwen3RotaryEmbedding(self.config)
        return self

    def new_context(self, capacity: int = 256) -> DraftContext:
        attn = self.layers[0].self_attn
        weight = self.fc.weight
        shape = (len(self.layers), 2, attn.num_kv_heads, capacity, attn.head_dim)
        return DraftContext(weight.new_zeros(shape))

    def _rope(self, x: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + length, device=x.device)[None]
        cos, sin = self.rotary_emb(x[None], positions)
        return cos[0], sin[0]

    @torch.no_grad()
    def extend(self, context: DraftContext, features: torch.Tensor) -> None:
        """Append the target features [m, len(target_layer_ids) * hidden] of the m newly committed tokens."""
        start, m = context.length, features.shape[0]
        context.reserve(start + m)
        projected = self.hidden_norm(self.fc(features))
        cos, sin = self._rope(projected, start, m)
        for index, layer in enumerate(self.layers):
            keys, values = layer.self_attn.keys_values(projected, cos, sin)
            context.buffer[index, 0, :, start : start + m] = keys
            context.buffer[index, 1, :, start : start + m] = values
        context.length = start + m

    @torch.no_grad()
    def extend_fixed(self, context: DraftContext, features: torch.Tensor, count: torch.Tensor) -> None:
        """`extend` in fixed shapes: all L rows of `features` [L, …] are written after the context (rows past
        `count`, a device scalar, land beyond the new length, where nothing reads them), and the length grows
        by `count` on the device. The buffer must have room (`reserve`)."""
        length = context.to_device_length()
        slots = length + torch.arange(features.shape[0], device=features.device)
        projected = self.hidden_norm(self.fc(features))
        cos, sin = self.rotary_emb(projected[None], slots[None])
        for index, layer in enumerate(self.layers):
            keys, values = layer.self_attn.keys_values(projected, cos[0], sin[0])
            context.buffer[index, 0].index_copy_(1, slots, keys)
            context.buffer[index, 1].index_copy_(1, slots, values)
        length.add_(count)

    @torch.no_grad()
    def propose_fixed(
        self, context: DraftContext, root_embedding: torch.Tensor, mask_embedding: torch.Tensor, head: nn.Module
    ) -> torch.Tensor:
        """`propose` with the context's length on the device; the buffer must have room for the block."""
        length = context.to_device_length()
        slots = length + torch.arange(self.block_size, device=root_embedding.device)
        block = torch.cat([root_embedding[None], mask_embedding[None].expand(self.block_size - 1, -1)])
        cos, sin = self.rotary_emb(block[None], slots[None])
        h = block
        for index, layer in enumerate(self.layers):
            h = layer.forward_fixed(h, cos[0], sin[0], context.buffer[index], slots)
        logits = head(self.norm(h[1:]))
        return logits.to(compute_dtype(logits.dtype))

    @torch.no_grad()
    def propose(
        self, context: DraftContext, root_embedding: torch.Tensor, mask_embedding: torch.Tensor, head: nn.Module
    ) -> torch.Tensor:
        """Logits [block_size-1, vocab] (float32, float64 for a float64 draft) of the positions after the root,
        which sits just past the context."""
        if context.length == 0:
            raise RuntimeError("the drafter has no context: extend it with the prompt's features first")
        context.reserve(context.length + self.block_size)
        block = torch.cat([root_embedding[None], mask_embedding[None].expand(self.block_size - 1, -1)])
        cos, sin = self._rope(block, context.length, self.block_size)
        h = block
        for index, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            h = h + layer.self_attn(x, cos, sin, context.buffer[index], context.length)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = head(self.norm(h[1:]))
        return logits.to(compute_dtype(logits.dtype))


# Keys of a checkpoint's config.json that describe the file, not the model.
_FILE_KEYS = ("architectures", "auto_map", "model_type", "transformers_version")


def draft_config(values: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config(**{k: v for k, v in values.items() if k not in _FILE_KEYS})


def build_draft(config: dict[str, Any], seed: int, dtype: torch.dtype, device: torch.device) -> DFlashDraft:
    """A seeded draft from an inline config (tests, the embedded default)."""
    torch.manual_seed(seed)
    draft = DFlashDraft(draft_config(config))
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=float(config.get("initializer_range", 0.02)))
    return draft.cast(device, dtype).eval()


def load_draft(path: Path, dtype: torch.dtype, device: torch.device) -> DFlashDraft:
    """A DFlash checkpoint directory: config.json and *.safetensors (embeddings and head come from the target).

    Weights are read straight onto `device`; nothing passes through host memory in float32."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"draft directory {path} has no config.json (model.draft.path)")
    values = json.loads(config_file.read_text())
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"draft directory {path} has no .safetensors weights")
    with torch.device(device):
        draft = DFlashDraft(draft_config(values)).cast(device, dtype)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard, device=str(device)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"draft weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return draft.eval()
