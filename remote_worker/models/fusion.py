"""Linears that read the same input, run as one matmul (the MLP block that uses them: `mlp.py`).

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
