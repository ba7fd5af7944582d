"""A verification tree: node 0 is the round's root (the last bonus token), the rest drafted tokens.

Nodes are in topological order (a parent before its children), so every ancestor mask is lower triangular.
A chain (DFlash, prefill, an AR step) is the tree whose every node's parent is the node before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [n] token ids
    parents: torch.Tensor  # [n] parent index, -1 for the root
    depths: torch.Tensor  # [n] 0 for the root

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if n == 0 or self.parents.shape != (n,) or self.depths.shape != (n,):
            raise ValueError("a tree needs at least one node and one parent and depth per node")
        if int(self.parents[0]) != -1 or bool((self.parents[1:] >= torch.arange(1, n)).any()):
            raise ValueError("nodes must be in topological order with node 0 as the root")

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def chain(tokens: torch.Tensor) -> Tree:
        n = tokens.shape[0]
        return Tree(tokens=tokens, parents=torch.arange(-1, n - 1), depths=torch.arange(n))

    @staticmethod
    def from_parents(tokens: torch.Tensor, parents: list[int] | torch.Tensor) -> Tree:
        parents = torch.as_tensor(parents, dtype=torch.long)
        depths = torch.zeros_like(parents)
        for i in range(1, parents.shape[0]):
            depths[i] = depths[parents[i]] + 1
        return Tree(tokens=tokens, parents=parents, depths=depths)

    def ancestor_mask(self) -> torch.Tensor:
        """A[i, j] = True when j is i or an ancestor of i."""
        n = self.size
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[int(self.parents[i])]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        path = [node]
        while path[-1] != 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]
