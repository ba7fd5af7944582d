"""A verification tree: node 0 is the round's root (the last bonus token), the rest drafted tokens.

Nodes are in topological order (a parent before its children), so every ancestor mask is lower triangular.
A chain (DFlash, prefill, an AR step) is the tree whose every node's parent is the node before it.
`parents` and `depths` live on the host (the tree builder and the walk down the tree read them there);
`tokens` may live on either side. Everything a layer needs on the device is built from them once per round
(`remote_worker.cache.tree_context`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [n] token ids
    parents: torch.Tensor  # [n] parent index, -1 for the root (host)
    depths: torch.Tensor  # [n] 0 for the root (host)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if n == 0 or self.parents.shape != (n,) or self.depths.shape != (n,):
            raise ValueError("a tree needs at least one node and one parent and depth per node")
        if int(self.parents[0]) != -1 or bool((self.parents[1:] >= torch.arange(1, n)).any()):
            raise ValueError("nodes must be in topological order with node 0 as the root")

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """The deepest node's depth (0 for a lone root)."""
        return int(self.depths[-1]) if self.is_chain else int(self.depths.max())

    @property
    def is_chain(self) -> bool:
        return bool(int(self.depths[-1]) == self.size - 1)

    @staticmethod
    def chain(tokens: torch.Tensor) -> Tree:
        n = tokens.shape[0]
        return Tree(tokens=tokens, parents=torch.arange(-1, n - 1), depths=torch.arange(n))

    @staticmethod
    def from_parents(tokens: torch.Tensor, parents: list[int] | torch.Tensor, depths: list[int] | None = None) -> Tree:
        """A tree from its parent list; the depths are derived when the builder does not already know them."""
        parent_list = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
        if depths is None:
            depths = [0] * len(parent_list)
            for node in range(1, len(parent_list)):
                depths[node] = depths[parent_list[node]] + 1
        return Tree(tokens=tokens, parents=torch.tensor(parent_list, dtype=torch.long), depths=torch.tensor(depths))

    def ancestor_mask(self) -> torch.Tensor:
        """A[i, j] = True when j is i or an ancestor of i (host)."""
        return ancestor_mask(self.parents, self.depth)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        parents = self.parents.tolist()
        path = [node]
        while path[-1] != 0:
            path.append(parents[path[-1]])
        return path[::-1]


def ancestor_mask(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a tree of the given depth, on `parents`' device, in ⌈log₂ depth⌉ steps.

    Start from "j is i or i's parent" (reach 1) and square: each product doubles the reach, so after s
    squarings M[i, j] = 1 exactly when j is within 2**s steps above i. The entries stay 0/1 in float
    (`clamp`), so the products are exact for any tree this size."""
    n = parents.shape[0]
    reach = torch.eye(n, device=parents.device)
    reach[torch.arange(1, n, device=parents.device), parents[1:]] = 1.0
    for _ in range(max(depth - 1, 0).bit_length()):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach.bool()
