"""Draft trees from the drafter's per-position logits.

DFlash takes the most likely token at each position: a chain. DDTree (arXiv 2604.12989) spends a node
budget on the most likely continuations: a node is a choice of rank at each depth, scored by its summed
log-probability, and a best-first heap pops nodes in score order. A popped node offers two successors —
its next sibling (same depth, next rank) and its first child (next depth, rank 0) — so the heap never
holds more than two entries per node, and a parent is always popped before its children.

Ties are frequent in bfloat16, and a different tie rule gives a different tree from the same draft. So
this follows the paper's code exactly: a position's candidates are ranked by `topk` of the logits, the
log-probabilities are the top logits minus their log-sum-exp, a sibling's score is computed as the
node's score minus its own log-probability plus the sibling's (the same floating-point sum), and equal
scores pop in lexicographic order of their rank paths ((0, 0) before (0, 1) before (1, 0)).
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


def _assemble(tokens: list[int], parents: list[int], scores: list[float], depths: list[int]) -> DraftTree:
    children: list[dict[int, int]] = [{} for _ in tokens]
    for index, parent in enumerate(parents[1:], start=1):
        children[parent][tokens[index]] = index
    tree = Tree.from_parents(torch.tensor(tokens, dtype=torch.long), parents, depths)
    return DraftTree(tree=tree, children=children, scores=scores)


def top_candidates(logits: torch.Tensor, width: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per position, the `width` best tokens by logit and their log-probabilities (host lists)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    top_logits, top_ids = torch.topk(logits, k=width, dim=-1)
    log_probs = top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return log_probs.tolist(), top_ids.tolist()


def chain_tree(root: int, logits: torch.Tensor, length: int) -> DraftTree:
    """DFlash: the root and the argmax token at each of the first `length` positions.

    logits: [positions, vocab] (log-probabilities work too: they rank the same). Ties go to the lowest
    token id, as `argmax` breaks them in the reference's chain."""
    logits = logits[:length].double()
    picked = logits.argmax(dim=-1)
    log_probs = (logits.gather(-1, picked[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).tolist()
    tokens, scores = [root, *picked.tolist()], [0.0]
    for value in log_probs:
        scores.append(scores[-1] + value)
    return _assemble(tokens, list(range(-1, len(tokens) - 1)), scores, list(range(len(tokens))))


def best_first_tree(root: int, logits: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the `budget` highest-scoring nodes below the root, in topological (= pop) order.

    logits: [positions, vocab] (log-probabilities work too: the log-sum-exp is then 0)."""
    depth_limit = logits.shape[0]
    width = min(budget, logits.shape[1])
    if budget <= 0 or depth_limit == 0:
        return _assemble([root], [-1], [0.0], [0])
    log_probs, ids = top_candidates(logits, width)
    tokens, parents, scores, depths = [root], [-1], [0.0], [0]
    # Heap entries: (-score, rank path from depth 1, parent node). Equal scores pop by rank path.
    heap: list[tuple[float, tuple[int, ...], int]] = [(-log_probs[0][0], (0,), 0)]
    while heap and len(tokens) - 1 < budget:
        negative, ranks, parent = heapq.heappop(heap)
        depth, rank, score = len(ranks), ranks[-1], -negative
        node = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        scores.append(score)
        depths.append(depth)
        if rank + 1 < width:
            sibling = score - log_probs[depth - 1][rank] + log_probs[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, (*ranks[:-1], rank + 1), parent))
        if depth < depth_limit:
            heapq.heappush(heap, (-(score + log_probs[depth][0]), (*ranks, 0), node))
    return _assemble(tokens, parents, scores, depths)
