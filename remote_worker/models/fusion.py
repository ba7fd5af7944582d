"""Linears that read the same input, run as one matmul.

A GDN layer projects its input four times (q|k|v, z, b, a), attention three times (q, k, v), an MLP twice
(gate, up). On a GPU each projection is a kernel launch, and the small ones (b and a give one value per
head) are nothing but launch. `FusedLinear` concatenates their weights once into one [Σ out, in] tensor and
makes each linear's weight a view of its rows: the model's own forward still works and sees the same
values, and no memory is added (each layer's old weights are freed as soon as its fused copy exists).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear:
    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        weights = [linear.weight for linear in linears]
        same = all(w.dtype == weights[0].dtype and w.device == weights[0].device for w in weights)
        self.weight: torch.Tensor | None = None
        if len(linears) == 1:  # one linear: called without nn.Module's per-call machinery
            self.weight, self.bias = weights[0].detach(), linears[0].bias
            return
        self.bias = None
        if same and all(linear.bias is None for linear in linears):  # (the supported models have no biases)
            with torch.no_grad():
                self.weight = torch.cat([w.detach() for w in weights])
            offset = 0
            for linear, rows in zip(linears, self.sizes, strict=True):
                linear.weight = nn.Parameter(self.weight[offset : offset + rows], requires_grad=False)
                offset += rows

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each linear's output, as views of one product (or each linear's own call where they cannot fuse)."""
        if self.weight is None:
            return tuple(linear(x) for linear in self.linears)
        if len(self.linears) == 1:
            return (F.linear(x, self.weight, self.bias),)
        return torch.split(F.linear(x, self.weight), self.sizes, dim=-1)


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
            from remote_worker.models.moe import SparseMoE, is_sparse_moe

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
