"""A sparse mixture-of-experts block (Qwen3-Next, Qwen3.5/3.6-MoE) in fixed shapes, for compiled rounds.

Transformers' block loops over the experts a batch hits and slices each one's tokens out with `where`:
how many iterations and rows depend on the routing's values, so it cannot be one fixed-shape graph. Here
every shape depends only on the number of tokens n and the routed experts per token k:

- routing: the router's softmax (float32, as the module computes it; float64 for a float64 model, the
  worker's reference), top-k, renormalised where the model does;
- the n·k (token, expert) assignments: on a GPU in bfloat16, sorted by expert with per-expert offsets
  (`bincount` + `cumsum`, on the device) and run as two grouped matmuls (`torch._grouped_mm`); elsewhere
  (a CPU, float32/float64, where the pinned torch's compiled grouped matmul takes bfloat16 only), in a
  compiled graph, each assignment's expert weights are gathered and run as a batched matmul, 64 assignments
  at a time (fixed shapes, but a copy of an expert's weights per assignment); run eagerly, where those copies
  would pass `GATHER_BYTES`, the assignments sorted by expert and each expert's rows through it as one
  matmul, as the module's own loop runs them (shapes that follow the routing, which only a graph needs
  fixed; at tiny_qwen3_next's widths on a CPU 15× faster than the copies at a tree's 257 tokens, 1.4×
  slower at one token, where the loop's host read of the counts is most of the work);
- the combine: each token's k weighted outputs summed in ascending expert order, one after another, the
  order in which the module's loop adds them (`index_add_` over the experts it hits, from zero);
- the shared expert and its sigmoid gate, as the module.

`module_reference` is transformers' own block (with the float64 router for a float64 model), kept as the
naive reference and tied to this one by `tests/test_moe.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remote_worker.models.fusion import FusedLinear

# Assignments whose expert weights are gathered at once, off the grouped path: at Qwen3-Next's widths
# (2048 hidden, 512 per expert) 64 experts' weights are 800 MB in float32.
GATHERED = 64
# Eagerly, the gathered copies up to this many bytes (a few tokens at tiny widths), else the loop over experts.
GATHER_BYTES = 512 << 10


def is_sparse_moe(mlp: nn.Module) -> bool:
    """A router (`gate` with `weight` and `top_k`) and experts stored as 3-D tensors."""
    router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    return (
        all(hasattr(router, a) for a in ("weight", "top_k"))
        and all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj", "act_fn"))
        and getattr(experts.gate_up_proj, "dim", lambda: 0)() == 3
    )


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Where `torch._grouped_mm` compiles: CUDA devices of compute capability 9.0 on, in bfloat16."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


class SparseMoE:
    """The block's weights, read once from the module (views, no copy), and its forward in fixed shapes."""

    def __init__(self, mlp: nn.Module) -> None:
        self.mlp = mlp
        router, experts = mlp.gate, mlp.experts
        self.router_weight = router.weight.detach()  # [E, hidden]
        self.top_k = int(router.top_k)
        # Qwen3-Next's router says whether it renormalises; Qwen3.5/3.6-MoE's always does
        self.normalize = bool(getattr(router, "norm_topk_prob", True))
        self.gate_up = experts.gate_up_proj.detach()  # [E, 2·I, hidden]
        self.down = experts.down_proj.detach()  # [E, hidden, I]
        self.act_fn = experts.act_fn
        shared = getattr(mlp, "shared_expert", None)
        self.shared = None
        if shared is not None:
            self.shared = (FusedLinear(shared.gate_proj, shared.up_proj), FusedLinear(shared.down_proj), shared.act_fn)
        gate = getattr(mlp, "shared_expert_gate", None)
        self.shared_gate = None if gate is None else FusedLinear(gate)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] → (weights [n, k] in x's dtype, experts [n, k]), as the module's router."""
        logits = F.linear(x, self.router_weight)
        probabilities = F.softmax(logits, dim=-1, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def expert_outputs(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each assignment's expert output [n·k, hidden] (row i: token i // k through experts.flatten()[i])."""
        rows, chosen = x.repeat_interleave(self.top_k, dim=0), experts.flatten()  # [n·k, hidden], [n·k]
        if grouped_mm_supported(x):
            return self.grouped(rows, chosen)
        copies = rows.shape[0] * (self.gate_up[0].numel() + self.down[0].numel()) * rows.element_size()
        if torch.compiler.is_compiling() or copies <= GATHER_BYTES:
            return self.gathered(rows, chosen)
        return self.looped(rows, chosen)

    def grouped(self, rows: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The assignments sorted by expert, per-expert offsets, two grouped matmuls, unsorted."""
        order = chosen.argsort(stable=True)
        offsets = torch.bincount(chosen, minlength=self.gate_up.shape[0]).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(rows[order], self.gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(self.act_fn(gate) * up, self.down.transpose(1, 2), offs=offsets)
        return torch.empty_like(out).index_copy_(0, order, out)

    def gathered(self, rows: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each assignment's expert weights gathered, `GATHERED` assignments at a time, as batched matmuls."""
        outs = []
        for start in range(0, chosen.shape[0], GATHERED):  # a fixed count: n·k is a shape
            index, part = chosen[start : start + GATHERED], rows[start : start + GATHERED]
            gate, up = torch.bmm(self.gate_up[index], part[:, :, None])[..., 0].chunk(2, dim=-1)  # [m, I] each
            outs.append(torch.bmm(self.down[index], (self.act_fn(gate) * up)[:, :, None])[..., 0])
        return torch.cat(outs)

    def looped(self, rows: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Eager only (its loop and shapes follow the routing, read on the host): the assignments sorted by
        expert, each expert's rows through its two matmuls at once, unsorted."""
        order = chosen.argsort(stable=True)
        counts = torch.bincount(chosen, minlength=self.gate_up.shape[0]).tolist()
        outs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                part = rows[order[start : start + count]]
                gate, up = F.linear(part, self.gate_up[expert]).chunk(2, dim=-1)
                outs.append(F.linear(self.act_fn(gate) * up, self.down[expert]))
                start += count
        out = torch.cat(outs)
        return torch.empty_like(out).index_copy_(0, order, out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] → [n, hidden]."""
        n, k = x.shape[0], self.top_k
        weights, experts = self.route(x)
        weighted = (self.expert_outputs(x, experts) * weights.reshape(-1, 1)).view(n, k, -1)
        # summed one by one in ascending expert order, as the module's loop adds them (from zero)
        order = experts.argsort(dim=-1, stable=True)
        weighted = weighted.gather(1, order[..., None].expand(-1, -1, weighted.shape[-1]))
        out = torch.zeros_like(x)
        for slot in range(k):
            out = out + weighted[:, slot]
        if self.shared is not None:
            gate_up, down, act = self.shared
            gate, up = gate_up(x)
            shared = down(act(gate) * up)[0]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)[0]) * shared
            out = out + shared
        return out
