"""A target model run layer by layer over a tree, with the hybrid-aware cache.

The model's own modules supply every weight and the norms, MLPs and rotary embedding; only the token
mixers (full attention, Gated DeltaNet) run through the cache. Embeddings and head are found with the
model's accessors, layers through `get_decoder()`, GDN layers by their parameters, so the same code serves
Qwen3.5/3.6 (causal LM or the multimodal class used text-only), Qwen3-Next and dense Qwen3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from remote_worker.cache.hybrid_cache import CacheLayout, HybridCache
from remote_worker.cache.tree import Tree
from remote_worker.cache.tree_context import TreeContext
from remote_worker.models.blocks import decoder_block
from remote_worker.models.mixers import AttentionMixer, GDNMixer, RotaryTables
from remote_worker.models.mlp import GatedMLP
from remote_worker.models.norms import FastRMSNorm


def is_gdn(module: nn.Module) -> bool:
    return hasattr(module, "A_log") and hasattr(module, "conv1d") and hasattr(module, "dt_bias")


def is_attention(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))


def token_mixer(layer: nn.Module) -> tuple[str, nn.Module]:
    for module in layer.children():
        if is_gdn(module):
            return "gdn", module
        if is_attention(module):
            if getattr(module, "sliding_window", None):
                raise NotImplementedError("sliding-window attention layers in the target are not supported")
            return "attention", module
    raise TypeError(f"decoder layer {type(layer).__name__} has neither attention nor a Gated DeltaNet mixer")


def prefill_chunk(device: torch.device) -> int:
    """Tokens per prefill step: on a GPU a bigger chain keeps the weights' reads amortised (the GDN solve is
    quadratic in the chunk, so not unbounded); on a CPU compute dominates and small chunks are as fast."""
    return 256 if device.type == "cuda" else 64


@dataclass(frozen=True)
class VerifyOutput:
    logits: torch.Tensor | None  # [n, vocab]; None when not asked for (prefill)
    hidden: dict[int, torch.Tensor]  # layer index (1-based, 0 = embeddings) -> [n, hidden]


class TargetModel:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        decoder = model.get_decoder()
        self.embed = model.get_input_embeddings()
        self.head = model.get_output_embeddings()
        self.layers = list(decoder.layers)
        self.norm = decoder.norm
        self.rotary = decoder.rotary_emb
        self.kinds, modules = zip(*(token_mixer(layer) for layer in self.layers), strict=True)
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        slots = {"gdn": 0, "attention": 0}
        self.mixers: list[AttentionMixer | GDNMixer] = []
        for kind, module in zip(self.kinds, modules, strict=True):
            mixer = GDNMixer(module, slots[kind], self.dtype) if kind == "gdn" else AttentionMixer(module, slots[kind])
            slots[kind] += 1
            self.mixers.append(mixer)
        self.head_dim = next((m.head_dim for m in self.mixers if isinstance(m, AttentionMixer)), None)
        self.rope = RotaryTables(self.rotary, self.head_dim) if self.head_dim is not None else None
        self.norms = [
            (FastRMSNorm(layer.input_layernorm), FastRMSNorm(layer.post_attention_layernorm)) for layer in self.layers
        ]
        self.final_norm = FastRMSNorm(self.norm)
        self.mlps = [GatedMLP(layer.mlp) for layer in self.layers]
        self.blocks = [decoder_block(*parts) for parts in zip(self.mixers, self.mlps, self.norms, strict=True)]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layout(self) -> CacheLayout:
        attention = next((m for m in self.mixers if isinstance(m, AttentionMixer)), None)
        gdn = next((m for m in self.mixers if isinstance(m, GDNMixer)), None)
        return CacheLayout(
            device=self.device,
            dtype=self.dtype,
            attention=None if attention is None else (attention.kv_heads, attention.head_dim),
            gdn=None if gdn is None else gdn.state_shape,
        )

    def new_cache(self, capacity: int = 64) -> HybridCache:
        """An empty cache with every buffer allocated (K/V for `capacity` tokens; it grows by doubling)."""
        return HybridCache(list(self.kinds), self.layout, capacity)

    def verify(self, cache: HybridCache, tree: Tree, hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        """Logits at every node (the prediction of the token that follows it); the committed state is unchanged."""
        return self.forward(cache, tree, hidden_layers, logits=True)

    @torch.no_grad()
    def forward(self, cache: HybridCache, tree: Tree, hidden_layers: tuple[int, ...], logits: bool) -> VerifyOutput:
        """The tree through every layer (see `verify`); the LM head only if `logits`. Everything the layers
        need about the tree is built once (`cache.begin`), on the device."""
        ctx = cache.begin(tree, self.device, self.dtype)
        return self._through_layers(ctx, cache, cache.length + tree.depth + 1, hidden_layers, logits)

    def compile_problem(self) -> str | None:
        """Why this model's layers cannot be one fixed-shape graph, or None. A block of experts other than the
        supported sparse ones runs its module's forward, whose loop depends on the routing's values."""
        if any(mlp.gate_up is None and mlp.moe is None for mlp in self.mlps):
            return (
                "its mixture-of-experts blocks run transformers' loop over the experts each batch hits, whose "
                "length depends on the routing: not one fixed-shape graph"
            )
        return None

    def reserve_positions(self, capacity: int) -> None:
        """Rotary tables for `capacity` positions, built now (fixed-shape rounds and prefills call this first)."""
        if self.rope is not None:
            self.rope.reserve(capacity, self.embed.weight)

    @torch.no_grad()
    def verify_fixed(
        self,
        cache: HybridCache,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        depths: torch.Tensor,
        depth: int,
        hidden_layers: tuple[int, ...] = (),
        logits: bool = True,
    ) -> VerifyOutput:
        """`verify` of a tree already on the device ([n] tokens, parents, depths, at most `depth` deep), in
        shapes that depend only on n and the cache's capacity: no device value is read, nothing grows. The LM
        head only if `logits` (a prefill needs none)."""
        ctx = cache.begin_fixed(tokens, parents, depths, depth, self.dtype)
        return self._through_layers(ctx, cache, cache.capacity, hidden_layers, logits)

    def _through_layers(
        self, ctx: TreeContext, cache: HybridCache, positions: int, hidden_layers: tuple[int, ...], logits: bool
    ) -> VerifyOutput:
        """The round's tree (`ctx`) embedded, rotated (tables for `positions` positions) and through every
        layer; the LM head only if `logits`."""
        h = self.embed(ctx.tokens)
        if self.rope is not None:
            ctx.rope = self.rope(ctx.positions, positions, h)
        states = self._layers(h, ctx, cache)
        hidden = {index: states[index] for index in hidden_layers}
        return VerifyOutput(logits=self.head(self.final_norm(states[-1])) if logits else None, hidden=hidden)

    def _layers(self, h: torch.Tensor, ctx: TreeContext, cache: HybridCache) -> list[torch.Tensor]:
        """h [n, hidden] through every decoder layer: the hidden states from the embeddings' (index 0) on."""
        states = [h]
        for block in self.blocks:
            h = block.run(h, ctx, cache)
            states.append(h)
        return states

    def prefill(
        self, cache: HybridCache, tokens: torch.Tensor, hidden_layers: tuple[int, ...] = (), chunk: int | None = None
    ) -> torch.Tensor:
        """Commit `tokens` in chunks (a chain each); no logits are computed. Returns the hidden states of
        `hidden_layers` for every token, concatenated along the feature axis ([len(tokens),
        len(hidden_layers) * hidden]; empty without layers)."""
        if tokens.shape[0] == 0:
            raise ValueError("prefill needs at least one token")
        chunk = chunk or prefill_chunk(self.device)
        features = []
        for start in range(0, tokens.shape[0], chunk):
            piece = tokens[start : start + chunk]
            output = self.forward(cache, Tree.chain(piece), hidden_layers, logits=False)
            cache.commit(list(range(piece.shape[0])))
            if hidden_layers:
                features.append(torch.cat([output.hidden[i] for i in hidden_layers], dim=-1))
        return torch.cat(features) if features else torch.empty(0)
