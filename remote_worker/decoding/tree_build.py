"""Draft trees from the drafter's per-position logits.

DFlash takes the most likely token at each position: a chain. DDTree (arXiv 2604.12989) spends a node
budget on the most likely continuations: a node is a choice of rank at each depth, scored by its summed
log-probability, and a best-first heap pops nodes in score order. A popped node offers two successors —
its next sibling (same depth, next rank) and its first child (next depth, rank 0) — so the heap never
holds more than two entries per node, and a parent is always popped before its children.

Ties are frequent in bfloat16, and a different tie rule gives a different tree from the same draft. So
this follows the paper's code: the log-probabilities are the top logits minus their log-sum-exp, a
sibling's score is computed as the node's score minus its own log-probability plus the sibling's (the same
floating-point sum), and equal scores pop in lexicographic order of their rank paths ((0, 0) before (0, 1)
before (1, 0)).

One rule is ours, not the paper's: equal logits are ranked by token id, lowest first (`ranked_candidates`),
as `argmax` ranks DFlash's chain. The paper ranks with `topk(k=budget)`, whose order among equal logits is
the kernel's and changes with k (on a CPU, for most rows with ties), so its tree at a tie depends on the
budget. With a rank that does not, a tree is a function of the logits alone, and:

The prefix property. The tree of budget b is the first b nodes of the tree of any budget B ≥ b, in the
same order. The heap's key (−score, rank path) is a total order, and the two heaps push the same entries
except those with a rank ≥ b (width b against B). Such a node is pushed only after its elder siblings
(ranks 0 … b−1) were popped, so it cannot be among the first b pops; and since the heap always pops its
least key, the first b pops of both heaps are the same nodes. So one verified round at budget B tells what
a round at any budget b ≤ B would have accepted from the same state: the accepted path's nodes numbered ≤ b
(`decoding.budget_curve`).
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
    ranks: list[int]  # per node: its place among its parent's candidates, 0 the draft's first choice (root: 0)


def _assemble(
    tokens: list[int], parents: list[int], scores: list[float], depths: list[int], ranks: list[int]
) -> DraftTree:
    children: list[dict[int, int]] = [{} for _ in tokens]
    for index, parent in enumerate(parents[1:], start=1):
        children[parent][tokens[index]] = index
    tree = Tree.from_parents(torch.tensor(tokens, dtype=torch.long), parents, depths)
    return DraftTree(tree=tree, children=children, scores=scores, ranks=ranks)


def ranked_candidates(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, the `width` best tokens: ([D, W] logits, [D, W] token ids), ordered by logit, equal
    logits by token id (lowest first), on the logits' device and in fixed shapes (the device tree compiles
    it). The first w of them are the same for every width ≥ w: the order is a total order of the vocabulary.

    `topk` alone cannot give that: which of several equal logits it returns, and in what order, is its
    kernel's choice and changes with k. So its k-th value is only the threshold: every logit above it is
    taken, and of those equal to it the lowest ids, as many as there is room for; a stable sort of the
    taken logits (in id order) then orders them."""
    vocab = logits.shape[-1]
    threshold = torch.topk(logits, k=width, dim=-1).values[:, -1:]
    above, tied = logits > threshold, logits == threshold
    room = width - above.sum(dim=-1, keepdim=True)
    taken = above | (tied & (tied.cumsum(dim=-1) <= room))  # exactly `width` per row
    index = torch.arange(vocab, device=logits.device)
    ids = torch.topk(torch.where(taken, vocab - index, 0), k=width, dim=-1).indices  # taken ids, lowest first
    values = logits.gather(-1, ids)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), ids.gather(-1, order)


def top_candidates(logits: torch.Tensor, width: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per position, the `width` best tokens (`ranked_candidates`) and their log-probabilities (host lists).

    Where no two of a row's `width` + 1 best logits are equal, `topk`'s own sorted answer is that order (there
    is no tie for its kernel to break), so the rows are taken from it; only logits with a tie there (frequent in
    bfloat16) or a NaN go through `ranked_candidates`' tie rule. The result is the same either way (a test ties
    the two on logits with and without ties); the fast path is a third of the cost on a CPU."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    top_logits, top_ids = torch.topk(logits, k=min(width + 1, logits.shape[-1]), dim=-1)
    if not bool((top_logits[:, 1:] < top_logits[:, :-1]).all()):  # a tie (or a NaN) at the top: the rule's order
        top_logits, top_ids = ranked_candidates(logits, width)
    top_logits, top_ids = top_logits[:, :width], top_ids[:, :width]
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
    depths = list(range(len(tokens)))
    return _assemble(tokens, list(range(-1, len(tokens) - 1)), scores, depths, [0] * len(tokens))


@dataclass(frozen=True)
class Growth:
    """A best-first tree as the heap popped it, in host lists (node 0 the root): what `DraftTree` is assembled
    from. `first(n)` is the tree of budget n (the prefix property), assembled without the rest."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]  # summed draft log-probability of each node's path (the root: 0)
    depths: list[int]
    ranks: list[int]

    @property
    def nodes(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.tokens) - 1

    def prefix(self, budget: int) -> Growth:
        """The growth of budget `budget` (by the prefix property: its first nodes)."""
        end = min(budget, self.nodes) + 1
        return Growth(self.tokens[:end], self.parents[:end], self.scores[:end], self.depths[:end], self.ranks[:end])

    def first(self, budget: int) -> DraftTree:
        grown = self.prefix(budget)
        return _assemble(grown.tokens, grown.parents, grown.scores, grown.depths, grown.ranks)


def grow_best_first(root: int, logits: torch.Tensor, budget: int) -> Growth:
    """The heap's pops of `best_first_tree`, not yet assembled into a tree (see it)."""
    depth_limit = logits.shape[0]
    width = min(budget, logits.shape[1])
    if budget <= 0 or depth_limit == 0:
        return Growth([root], [-1], [0.0], [0], [0])
    log_probs, ids = top_candidates(logits, width)
    tokens, parents, scores, depths, ranks_of = [root], [-1], [0.0], [0], [0]
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
        ranks_of.append(rank)
        if rank + 1 < width:
            sibling = score - log_probs[depth - 1][rank] + log_probs[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, (*ranks[:-1], rank + 1), parent))
        if depth < depth_limit:
            heapq.heappush(heap, (-(score + log_probs[depth][0]), (*ranks, 0), node))
    return Growth(tokens, parents, scores, depths, ranks_of)


def best_first_tree(root: int, logits: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the `budget` highest-scoring nodes below the root, in topological (= pop) order.

    logits: [positions, vocab] (log-probabilities work too: the log-sum-exp is then 0)."""
    return grow_best_first(root, logits, budget).first(budget)
