"""What every layer needs about the tree being verified, built once per round on the model's device.

The host holds the tree (the builder and the walk down it read it there); one copy brings its parents and
depths (and its tokens, when they are on the host) to the device, and everything else is derived there
with a handful of vectorised operations, shared by all layers: no layer moves anything between host and
device, and nothing here loops over nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from remote_worker.cache.gdn_math import conv_windows
from remote_worker.cache.tree import Tree, ancestor_mask


@dataclass
class TreeContext:
    tree: Tree | None  # the host copy (None for a fixed-shape round: the tree never leaves the device)
    committed: int | None  # tokens committed before the tree (None for a fixed-shape round: `slots` says)
    tokens: torch.Tensor  # [n] on the device
    positions: torch.Tensor  # [n] committed + depth
    parents: torch.Tensor  # [n] on the device, -1 for the root
    mask: torch.Tensor  # [n, n] bool, ancestor-or-self
    ancestors: torch.Tensor  # [n, n] the mask in the GDN compute dtype (its sums give the path decays)
    decay_bias: torch.Tensor  # [n, n] 0 where the mask holds, -inf elsewhere (GDN compute dtype)
    attention_bias: torch.Tensor  # [n, committed + n] 0 where visible, -inf elsewhere (model dtype)
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (cos, sin with signs, permutation)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # conv kernel -> [n, kernel] gather indices
    # A fixed-shape round: the cache slots [n] the nodes' K/V go to; attention then reads the whole capacity,
    # `attention_bias` being [n, capacity] (see `build_fixed`).
    slots: torch.Tensor | None = None

    @staticmethod
    def build(
        tree: Tree, committed: int, device: torch.device, dtype: torch.dtype, compute: torch.dtype
    ) -> TreeContext:
        tokens_on_host = tree.tokens.device.type == "cpu"
        rows = [tree.parents, tree.depths, *([tree.tokens] if tokens_on_host else [])]
        packed = torch.stack(rows).to(device)  # the round's one host→device copy for the tree
        parents, depths = packed[0], packed[1]
        tokens = packed[2] if tokens_on_host else tree.tokens
        mask, ancestors, decay_bias = _masks(parents, tree.depth, compute)
        n = tree.size
        attention_bias = torch.zeros(n, committed + n, dtype=dtype, device=device)
        attention_bias[:, committed:] = decay_bias
        return TreeContext(
            tree=tree,
            committed=committed,
            tokens=tokens,
            positions=depths + committed,
            parents=parents,
            mask=mask,
            ancestors=ancestors,
            decay_bias=decay_bias,
            attention_bias=attention_bias,
        )

    @staticmethod
    def build_fixed(
        tokens: torch.Tensor,
        parents: torch.Tensor,
        depths: torch.Tensor,
        length: torch.Tensor,
        depth: int,
        capacity: int,
        dtype: torch.dtype,
        compute: torch.dtype,
    ) -> TreeContext:
        """The same context for a tree already on the device, with every shape fixed: the committed `length`
        is a device scalar, so attention reads the cache's whole `capacity` with a mask instead of a slice
        whose size changes every round. `depth` bounds the tree's depth (the drafter's positions)."""
        n, device = tokens.shape[0], tokens.device
        mask, ancestors, decay_bias = _masks(parents, depth, compute)
        # Slot j of the cache: committed when j < length, else node j - length when that is an ancestor.
        columns = torch.arange(capacity, device=device)
        offset = columns - length
        in_tree = (offset >= 0) & (offset < n)
        visible = (columns < length) | (mask[:, offset.clamp(0, n - 1)] & in_tree)
        zero = torch.zeros((), dtype=dtype, device=device)
        attention_bias = torch.where(visible, zero, float("-inf"))
        return TreeContext(
            tree=None,
            committed=None,
            tokens=tokens,
            positions=depths + length,
            parents=parents,
            mask=mask,
            ancestors=ancestors,
            decay_bias=decay_bias,
            attention_bias=attention_bias,
            slots=length + torch.arange(n, device=device),
        )

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def conv_windows(self, kernel: int) -> torch.Tensor:
        """Each node's conv window (`gdn_math.conv_windows`), built the first time a layer with this kernel asks."""
        if kernel not in self.windows:
            self.windows[kernel] = conv_windows(self.parents, kernel)
        return self.windows[kernel]


def _masks(parents: torch.Tensor, depth: int, compute: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The ancestor-or-self mask [n, n] (bool), as 0/1 in the GDN compute dtype, and its log as the decay
    bias (log 1 = 0, log 0 = -inf)."""
    mask = ancestor_mask(parents, depth)
    ancestors = mask.to(compute)
    return mask, ancestors, ancestors.log()
