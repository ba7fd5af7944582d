"""A decoder layer's MLP block as the decode runs it: gate and up fused into one matmul (`fusion.py`), a sparse
mixture of experts in fixed shapes (`moe.py`), and the module's own forward (with float64 routing) as the
naive reference both are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remote_worker.models.fusion import FusedLinear
from remote_worker.models.moe import SparseMoE, is_sparse_moe


class GatedMLP:
    """down(act(gate(x)) · up(x)), with gate and up fused; a sparse mixture of experts runs in fixed shapes
    (`moe.SparseMoE`), any other block its own forward (with its routing in float64 for a float64 model:
    `float64_routing`, also the naive reference the fixed-shape block is tested against)."""

    def __init__(self, mlp: nn.Module) -> None:
        self.mlp = mlp
        plain = all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        self.gate_up = FusedLinear(mlp.gate_proj, mlp.up_proj) if plain else None
        self.down = FusedLinear(mlp.down_proj) if plain else None
        router = getattr(mlp, "gate", None)
        self.routed = not plain and all(hasattr(router, a) for a in ("weight", "top_k")) and hasattr(mlp, "experts")
        self.moe = None
        if not plain:
            self.moe = SparseMoE(mlp) if is_sparse_moe(mlp) else None

    def float64_routing(self, x: torch.Tensor) -> torch.Tensor:
        """The sparse block (Qwen3-Next, Qwen3.5/3.6-MoE) with the router's softmax in float64: the module's
        router computes it in float32 whatever the model's dtype, a rounding that a float64 model, the
        worker's reference, must not have (see `norms`). The experts and the shared expert are the module's."""
        mlp, router = self.mlp, self.mlp.gate
        probabilities = F.softmax(F.linear(x, router.weight), dim=-1)
        weights, experts = probabilities.topk(router.top_k, dim=-1)  # [n, k]
        if getattr(router, "norm_topk_prob", True):  # (Qwen3.5/3.6-MoE's router always renormalises)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = mlp.experts(x, experts, weights)
        if hasattr(mlp, "shared_expert"):
            shared = mlp.shared_expert(x)
            gate = getattr(mlp, "shared_expert_gate", None)
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] → [n, hidden]."""
        if self.moe is not None:
            return self.moe(x)
        if self.gate_up is None:
            if self.routed and x.dtype == torch.float64:
                return self.float64_routing(x)
            return self.mlp(x[None])[0]
        assert self.down is not None
        gate, up = self.gate_up(x)
        return self.down(self.mlp.act_fn(gate) * up)[0]


def module_reference(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Transformers' own block on x [n, hidden] (its loop over the experts hit), the router's softmax in
    float64 for a float64 x (see `GatedMLP.float64_routing`)."""
    mlp_ = GatedMLP(mlp)
    if x.dtype == torch.float64 and mlp_.routed:
        return mlp_.float64_routing(x)
    return mlp(x[None])[0]
