"""How the model is built: class, layer types, where embeddings and head live, size, hidden states."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel


def module_path(model: nn.Module, target: nn.Module | None) -> str:
    """Dotted path of `target` inside `model` (found by identity, not by guessing attribute names)."""
    if target is None:
        return "none"
    for name, module in model.named_modules():
        if module is target:
            return name or "<root>"
    return "not a submodule"


def layer_types(model: PreTrainedModel) -> list[str]:
    text_config = model.config.get_text_config(decoder=True)
    types = getattr(text_config, "layer_types", None)
    if types:
        return list(types)
    return ["full_attention"] * int(text_config.num_hidden_layers)


def probe_model(model: PreTrainedModel, input_ids: torch.Tensor) -> dict[str, Any]:
    types = layer_types(model)
    embeddings = model.get_input_embeddings()
    head = model.get_output_embeddings()
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states or ()
    num_layers = len(types)
    same_shape = all(h.shape == hidden[0].shape for h in hidden) if hidden else False
    return {
        "class": type(model).__name__,
        "num_layers": num_layers,
        "layer_types": types,
        "layer_type_counts": dict(sorted(Counter(types).items())),
        "embedding_module": module_path(model, embeddings),
        "head_module": module_path(model, head),
        "tied_embeddings": head is not None and head.weight is embeddings.weight,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "hidden_states_count": len(hidden),
        "hidden_states_per_layer_plus_embeddings": len(hidden) == num_layers + 1 and same_shape,
    }
