"""The DFlash block-diffusion drafter.

A few Qwen3-style decoder layers whose attention reads two things: the projected hidden states of chosen
target layers for every committed token (the context, cached), and the block being drafted — the last
bonus token followed by mask tokens — attended non-causally. The target's embedding and head are shared.
One forward drafts a whole block: a distribution for each of the block_size-1 positions after the root.

Weights load from a DFlash checkpoint directory (config.json with `dflash_config` and `block_size`,
safetensors weights named as in the published drafts), or are built from a tiny config with a seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from remote_worker.cache.hybrid_cache import apply_rope, compute_dtype


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
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        sliding = layer_types[layer_idx] == "sliding_attention"
        self.sliding_window: int | None = config.sliding_window if sliding else None

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        key = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        value = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(key, cos, sin), value

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x: the block [B, hidden]; context: cached (keys, values) [kv_heads, committed, d]."""
        n = x.shape[0]
        query = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim)).transpose(0, 1)
        query = apply_rope(query, cos, sin)
        block_keys, block_values = self.keys_values(x, cos, sin)
        keys = torch.cat([context[0], block_keys], dim=1)
        values = torch.cat([context[1], block_values], dim=1)
        groups = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        scores = (query @ keys.transpose(1, 2)) * self.scaling
        if self.sliding_window is not None:  # a key is visible while it is less than a window behind the query
            key_pos = torch.arange(keys.shape[1], device=x.device)
            query_pos = key_pos[-n:]
            hidden = key_pos[None, :] <= query_pos[:, None] - self.sliding_window
            scores = scores.masked_fill(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=compute_dtype(query.dtype)).to(query.dtype)
        return self.o_proj((weights @ values).transpose(0, 1).reshape(n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DFlashDraft(nn.Module):
    """The drafter and its context cache (one per sequence; `reset` before a new prompt)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        dflash = dict(getattr(config, "dflash_config", None) or {})
        if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
            raise ValueError("a DFlash config needs dflash_config.target_layer_ids and dflash_config.mask_token_id")
        self.config = config
        self.block_size = int(config.block_size)
        self.target_layer_ids = tuple(int(i) for i in dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._context: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target hidden-state indices (0 = embeddings) the drafter reads: the outputs of its target layers."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def context_length(self) -> int:
        return self._context[0][0].shape[1] if self._context else 0

    def reset(self) -> None:
        self._context = []

    def _rope(self, x: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + length, device=x.device)[None]
        cos, sin = self.rotary_emb(x[None], positions)
        return cos[0], sin[0]

    @torch.no_grad()
    def extend_context(self, features: torch.Tensor) -> None:
        """Append the target features [m, len(target_layer_ids) * hidden] of the m newly committed tokens."""
        start = self.context_length
        projected = self.hidden_norm(self.fc(features))
        cos, sin = self._rope(projected, start, features.shape[0])
        for index, layer in enumerate(self.layers):
            keys, values = layer.self_attn.keys_values(projected, cos, sin)
            if index < len(self._context):
                old_keys, old_values = self._context[index]
                keys, values = torch.cat([old_keys, keys], dim=1), torch.cat([old_values, values], dim=1)
                self._context[index] = (keys, values)
            else:
                self._context.append((keys, values))

    @torch.no_grad()
    def propose(self, root_embedding: torch.Tensor, mask_embedding: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Log-probabilities [block_size-1, vocab] for the positions after the root (at the context's end)."""
        if not self._context:
            raise RuntimeError("the drafter has no context: call extend_context with the prompt's features first")
        block = torch.cat([root_embedding[None], mask_embedding[None].expand(self.block_size - 1, -1)])
        cos, sin = self._rope(block, self.context_length, self.block_size)
        h = block
        for layer, context in zip(self.layers, self._context, strict=True):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, context)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = head(self.norm(h[1:]))
        return torch.log_softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)


def draft_config(values: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config(**values)


def build_draft(config: dict[str, Any], seed: int, dtype: torch.dtype, device: torch.device) -> DFlashDraft:
    """A seeded draft from an inline config (tests, the embedded default)."""
    torch.manual_seed(seed)
    draft = DFlashDraft(draft_config(config))
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=float(config.get("initializer_range", 0.02)))
    return draft.to(device=device, dtype=dtype).eval()


def load_draft(path: Path, dtype: torch.dtype, device: torch.device) -> DFlashDraft:
    """A DFlash checkpoint directory: config.json and *.safetensors (embeddings and head come from the target)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"draft directory {path} has no config.json (model.draft.path)")
    values = json.loads(config_file.read_text())
    draft = DFlashDraft(draft_config({k: v for k, v in values.items() if k not in ("architectures", "auto_map")}))
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(shard))
    if not state:
        raise FileNotFoundError(f"draft directory {path} has no .safetensors weights")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"draft weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return draft.to(device=device, dtype=dtype).eval()
