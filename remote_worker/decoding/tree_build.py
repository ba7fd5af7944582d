"""Draft trees from the drafter's per-position distributions.

DFlash takes the most likely token at each position: a chain. DDTree (arXiv 2604.12989) spends a node
budget on the most likely continuations: a node is a choice of rank at each depth, scored by its summed
log-probability, and a best-first heap pops nodes in score order. A popped node offers two successors —
its next sibling (same depth, next rank) and its first child (next depth, rank 0) — so the heap never
holds more than two entries per node, and a parent is always popped before its children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from remote_worker.cache.tree import Tree


@dataclass(frozen=True)
class DraftTree:
    tree: Tree
    children: list[dict[int, int]]  # per node: token -> child index
    scores: list[float]  # summed draft log-probability per node (0 for the root)


def _assemble(tokens: list[int], parents: list[int], scores: list[float]) -> DraftTree:
    children: list[dict[int, int]] = [{} for _ in tokens]
    for index, parent in enumerate(parents[1:], start=1):
        children[parent][tokens[index]] = index
    tree = Tree.from_parents(torch.tensor(tokens, dtype=torch.long), parents)
    return DraftTree(tree=tree, children=children, scores=scores)


def chain_tree(root: int, log_probs: torch.Tensor, length: int) -> DraftTree:
    """DFlash: the root and the argmax token at each of the first `length` positions."""
    top = log_probs[:length].max(dim=-1)
    tokens = [root, *top.indices.tolist()]
    scores = [0.0, *torch.cumsum(top.values.double(), 0).tolist()]
    return _assemble(tokens, list(range(-1, len(tokens) - 1)), scores)


def best_first_tree(root: int, log_probs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the `budget` highest-scoring nodes below the root, in topological (= pop) order."""
    depth_limit = log_probs.shape[0]
    width = min(budget, log_probs.shape[1])
    if budget <= 0 or depth_limit == 0:
        return _assemble([root], [-1], [0.0])
    values, indices = log_probs.double().topk(width, dim=-1)
    values, indices = values.tolist(), indices.tolist()
    tokens, parents, scores = [root], [-1], [0.0]
    # entries: (-score, tie-break counter, depth (1-based), rank, parent index)
    heap = [(-values[0][0], 0, 1, 0, 0)]
    counter = 1
    while heap and len(tokens) - 1 < budget:
        negative, _, depth, rank, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(indices[depth - 1][rank])
        parents.append(parent)
        scores.append(-negative)
        if rank + 1 < width:
            sibling = scores[parent] + values[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, counter, depth, rank + 1, parent))
            counter += 1
        if depth < depth_limit:
            heapq.heappush(heap, (-(scores[node] + values[depth][0]), counter, depth + 1, 0, node))
            counter += 1
    return _assemble(tokens, parents, scores)
