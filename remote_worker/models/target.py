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

from remote_worker.cache.hybrid_cache import HybridCache
from remote_worker.cache.tree import Tree


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


@dataclass(frozen=True)
class VerifyOutput:
    logits: torch.Tensor  # [n, vocab]
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
        self.kinds, self.mixers = zip(*(token_mixer(layer) for layer in self.layers), strict=True)
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self) -> HybridCache:
        return HybridCache(list(self.kinds))

    @torch.no_grad()
    def verify(self, cache: HybridCache, tree: Tree, hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        """Logits at every node (the prediction of the token that follows it); the committed state is unchanged."""
        tree = Tree(tree.tokens.to(self.device), tree.parents, tree.depths)
        ctx = cache.begin(tree, self.device, self.dtype)
        h = self.embed(tree.tokens)
        positions = (cache.length + tree.depths).to(self.device)[None]
        cos, sin = self.rotary(h[None], positions)
        cos, sin = cos[0], sin[0]
        hidden = {0: h} if 0 in hidden_layers else {}
        for index, (layer, kind, mixer, layer_cache) in enumerate(
            zip(self.layers, self.kinds, self.mixers, cache.layers, strict=True), start=1
        ):
            x = layer.input_layernorm(h)
            if kind == "gdn":
                h = h + layer_cache.forward(mixer, x, ctx)
            else:
                h = h + layer_cache.forward(mixer, x, cos, sin, ctx)
            h = h + layer.mlp(layer.post_attention_layernorm(h[None]))[0]
            if index in hidden_layers:
                hidden[index] = h
        return VerifyOutput(logits=self.head(self.norm(h)), hidden=hidden)

    def prefill(
        self, cache: HybridCache, tokens: torch.Tensor, hidden_layers: tuple[int, ...] = (), chunk: int = 64
    ) -> torch.Tensor:
        """Commit `tokens` in chunks (a chain each). Returns the hidden states of `hidden_layers` for every token,
        concatenated along the feature axis ([len(tokens), len(hidden_layers) * hidden]; empty without layers)."""
        if tokens.shape[0] == 0:
            raise ValueError("prefill needs at least one token")
        features = []
        for start in range(0, tokens.shape[0], chunk):
            piece = tokens[start : start + chunk]
            output = self.verify(cache, Tree.chain(piece), hidden_layers)
            cache.commit(list(range(piece.shape[0])))
            if hidden_layers:
                features.append(torch.cat([output.hidden[i] for i in hidden_layers], dim=-1))
        return torch.cat(features) if features else torch.empty(0)
