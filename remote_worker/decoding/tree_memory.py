"""What one DDTree round of n nodes must hold in memory, from the model's shapes: a budget the device cannot
hold is refused before any decode, in a line that says how much it needs, instead of a raw allocator error
mid-run.

The figure is a lower bound, counted from tensors a verify cannot avoid (the real peak is higher: weights,
activations, the allocator's slack):

- the tree's masks, held through every layer (`TreeContext`): the ancestor mask [n, n] as bool and twice in
  the GDN compute dtype (0/1 and its log), and the attention bias [n, context+n] in the model's dtype;
- the tree's K/V in the cache, every attention layer: [2, kv_heads, n, head_dim] in the model's dtype;
- GDN, kept for the commit, every GDN layer: the tree's normalised keys [Hk, n, d_k] and deltas [Hv, n, d_v]
  in the compute dtype, and the conv inputs [kernel-1+n, conv_dim] in the model's dtype;
- then the largest of what one step holds at a time: a GDN layer's decay and triangular system, [Hv, n, n]
  each, in the compute dtype (`gdn_math.tree_delta_rule`); an attention layer's scores [heads, n, context+n]
  in the model's dtype (a float mask with grouped K/V sends `scaled_dot_product_attention` to its math
  kernel, which materialises them); the logits of every node, [n, vocab], in the model's dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from remote_worker.cache.hybrid_cache import compute_dtype
from remote_worker.models.mixers import AttentionMixer, GDNMixer
from remote_worker.models.target import TargetModel

GIB = 1 << 30


@dataclass(frozen=True)
class TreeMemory:
    """Bytes by part (see the module): the first three are held together, the last three one at a time."""

    masks: int
    attention_kv: int
    gdn_kept: int
    gdn_layer: int
    attention_layer: int
    logits: int

    @property
    def total(self) -> int:
        return self.masks + self.attention_kv + self.gdn_kept + max(self.gdn_layer, self.attention_layer, self.logits)

    def parts(self) -> str:
        """The terms of `total`, named: they add up to it."""
        step = max(
            ("one GDN layer's scratch", self.gdn_layer),
            ("one attention layer's scores", self.attention_layer),
            ("logits", self.logits),
            key=lambda part: part[1],
        )
        named = (
            ("tree masks", self.masks),
            ("tree K/V", self.attention_kv),
            ("GDN states kept for the commit", self.gdn_kept),
            step,
        )
        return ", ".join(f"{name} {size / GIB:.1f}" for name, size in named if size)


def tree_memory(target: TargetModel, nodes: int, context: int) -> TreeMemory:
    """The bytes a round of `nodes` nodes over `context` committed tokens holds at least (see the module)."""
    width = torch.finfo(target.dtype).bits // 8
    compute = torch.finfo(compute_dtype(target.dtype)).bits // 8
    gdn = [m for m in target.mixers if isinstance(m, GDNMixer)]
    attention = [m for m in target.mixers if isinstance(m, AttentionMixer)]
    masks = nodes * nodes * (1 + 2 * compute) + nodes * (context + nodes) * width
    attention_kv = sum(2 * m.kv_heads * nodes * m.head_dim * width for m in attention)
    gdn_kept = gdn_layer = attention_layer = 0
    if gdn:
        history, conv_dim, hk, r, dk, dv = gdn[0].state_shape
        per_layer = nodes * (hk * dk + hk * r * dv) * compute + (history + nodes) * conv_dim * width
        gdn_kept = len(gdn) * per_layer
        gdn_layer = 2 * hk * r * nodes * nodes * compute
    if attention:
        attention_layer = max(m.heads for m in attention) * nodes * (context + nodes) * width
    logits = nodes * target.head.out_features * width
    return TreeMemory(masks, attention_kv, gdn_kept, gdn_layer, attention_layer, logits)


def free_bytes(device: torch.device) -> int | None:
    """Memory free for the decode: the GPU's free memory, or this machine's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else -1
    return pages * os.sysconf("SC_PAGE_SIZE") if pages > 0 else None


def largest_budget(target: TargetModel, context: int, free: int) -> int:
    """The largest budget whose tree (budget + 1 nodes) fits `free` by `tree_memory`'s count (0: none)."""
    low, high = 0, 1
    while tree_memory(target, high + 1, context).total <= free and high < 1 << 30:
        low, high = high, high * 2
    while low + 1 < high:
        middle = (low + high) // 2
        low, high = (middle, high) if tree_memory(target, middle + 1, context).total <= free else (low, middle)
    return low


def budget_problem(target: TargetModel, budget: int, context: int, free: int | None) -> str | None:
    """Why a tree of `budget` cannot be verified here, in one line; None when it can (or nothing is known)."""
    if free is None:
        return None
    need = tree_memory(target, budget + 1, context)
    if need.total <= free:
        return None
    return (
        f"decode.tree_budgets: budget {budget} needs at least {need.total / GIB:.1f} GiB for one tree at "
        f"{context} tokens of context ({need.parts()} GiB), more than the {free / GIB:.1f} GiB free on "
        f"{target.device}; the largest budget that fits is {largest_budget(target, context, free)}"
    )
