"""Draft trees built on the device in fixed shapes: the paper's best-first tree without a host heap.

`tree_build.best_first_tree` pops a heap on the host; it is the naive reference, and this module's
`device_best_first_tree` must give the same tree. Every tensor here has a shape fixed by (budget, block
size, vocabulary), so a round that builds its tree this way compiles once and replays as a graph.

Why per-depth selection gives the heap's tree
---------------------------------------------
A node is a rank path (r_1, …, r_d), r_i < W = min(budget, vocab), d ≤ D (the draft's positions). Order
nodes by the total order "higher score first, then lexicographically smaller rank path first" (a prefix
before its extensions). The heap generates each node from exactly one earlier node (its elder sibling, or
its parent for a first child), and every generated node comes after its generator in that order: a child's
score is the parent's plus a log-probability ≤ 0, and a sibling's is no higher than its elder's (below:
when that holds in floating point). Then the heap always holds the first node in the order not yet popped
(its generator precedes it, so it was popped and pushed it), so the heap pops nodes in exactly the total
order, and its tree T is the first `budget` nodes in that order. T is closed under parents.

Let F_1 be the first `budget` nodes among depth 1's W candidates, and F_d the first `budget` among the
W children of each node of F_{d-1}. By induction T's depth-d nodes T_d lie in F_d: they are children of
T_{d-1} ⊆ F_{d-1}, and they are the first |T_d| ≤ budget of all depth-d nodes in the order (T is a prefix of
the order), so also of the candidates of F_d, which contain them. Hence T is the first `budget` nodes of
F_1 ∪ … ∪ F_D, and the order of those is the heap's pop order. That is what this module computes: per
depth the first `budget` of [budget × W] candidates in that order (two partial selections), then one sort
of the D × budget survivors.

The scores and floating point
-----------------------------
The heap computes a first child's score as parent + a_0 and each sibling's as (elder − a_k) + a_{k+1},
in float64 from the drafter's log-probabilities a. When every sum parent + a_k is exact in float64 the two
agree bit for bit (elder − a_k is then the parent exactly), and siblings never rise above their elders, so
the proof above holds. Here each score is parent + a_k, and each such sum is checked for exactness with
Knuth's TwoSum (the rounding error is computed exactly and must be 0). Log-probabilities of float32 or
bfloat16 logits sit on a float32 grid, so float64 sums of them are exact unless a score spans more than 53
bits (say a log-probability of −1e-9 beside a score of −100); `exact` is False when any candidate's sum
was rounded, and only then can the tree differ from the heap's, at an exact tie of scores. The tokens a
decode emits are the target's in any case: the walk accepts only what the target chose.

Padding: the tree always has budget + 1 nodes. When the candidates run out (a vocabulary smaller than
the budget, one position), the rest are padding: `valid` False, parent the root, depth 1, token 0. No valid
node has a padding node as an ancestor, so none attends to one, and the walk never accepts one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from remote_worker.decoding.tree_build import ranked_candidates


@dataclass(frozen=True)
class DeviceTree:
    """A draft tree on the device, in a fixed shape: n = budget + 1 nodes (block_size for a chain)."""

    tokens: torch.Tensor  # [n] long, node 0 the root
    parents: torch.Tensor  # [n] long, -1 for the root; padding nodes hang off the root
    depths: torch.Tensor  # [n] long
    valid: torch.Tensor  # [n] bool, False for padding
    scores: torch.Tensor  # [n] float64 summed draft log-probability (0 at the root, -inf for padding)
    ranks: torch.Tensor  # [n] long: a node's place among its parent's candidates (0 at the root and padding)
    exact: torch.Tensor  # [] bool: every score sum was exact, so this is the heap's tree bit for bit

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def prefix(self, budget: int) -> DeviceTree:
        """The tree of budget `budget` ≤ this one's: its first `budget` + 1 nodes (views). A best-first tree's
        nodes are in the heap's pop order, whose first n are the tree of budget n (`tree_build`'s prefix
        property); each node's parent comes before it, and its rank among its parent's candidates is below n
        (its elder siblings come before it), so it is the same rank at width n."""
        end = budget + 1
        if not 1 <= budget < self.size:
            raise ValueError(f"a prefix of budget {budget} of a tree of {self.size - 1} drafted nodes")
        return DeviceTree(
            self.tokens[:end], self.parents[:end], self.depths[:end], self.valid[:end], self.scores[:end],
            self.ranks[:end], self.exact,
        )  # fmt: skip


def candidate_log_probs(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` best tokens per position and their log-probabilities, as `tree_build.top_candidates`
    computes them (same dtype steps, same ranking of ties), on the logits' device: ([D, W] float64, [D, W] long)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    top_logits, top_ids = ranked_candidates(logits, width)
    log_probs = top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return log_probs.double(), top_ids


def _exact_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fl(a + b) and whether it equals a + b exactly (TwoSum: the rounding error, computed exactly, is 0)."""
    total = a + b
    a_part = total - b
    b_part = total - a_part
    error = (a - a_part) + (b - b_part)
    return total, error == 0


def _lex_words(ranks: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Rows of `ranks` [N, D] (each entry in [-1, budget), -1 past a node's depth) packed into int64 words
    whose lexicographic order is the rows' lexicographic order, most significant word first."""
    bits = budget.bit_length()  # entries shifted to [0, budget]
    per_word = max(62 // bits, 1)
    words = []
    for start in range(0, ranks.shape[1], per_word):
        word = torch.zeros(ranks.shape[0], dtype=torch.long, device=ranks.device)
        for column in range(start, min(start + per_word, ranks.shape[1])):
            word = (word << bits) | (ranks[:, column] + 1)
        words.append(word)
    return words


def _first_in_order(score: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices of the first `budget` entries of `score` [N ≥ budget] by (score descending, index ascending),
    in index order. Two partial selections instead of a sort of all N: the `budget`-th best score is the
    threshold; every entry above it is in, and so are the lowest-indexed entries equal to it, as many as
    there is room for (exactly `budget` in all, since at least `budget` entries reach the threshold)."""
    threshold = torch.topk(score, budget).values[-1]
    above, tied = score > threshold, score == threshold
    room = budget - above.sum()
    taken = above | (tied & (tied.cumsum(0) <= room))
    # the taken entries, earliest first: a key that falls with the index, 0 for the rest
    index = torch.arange(score.shape[0], device=score.device)
    return torch.topk(torch.where(taken, score.shape[0] - index, 0), budget).indices


def device_best_first_tree(root: torch.Tensor, logits: torch.Tensor, budget: int) -> DeviceTree:
    """DDTree's best-first tree of `budget` nodes below `root` (a device scalar), in the heap's pop order.

    logits: [D, vocab] (the drafter's positions after the root); finite. See the module's doc for why this
    equals `tree_build.best_first_tree` and when (`exact`) it is bit for bit the same."""
    if budget < 1:
        raise ValueError("a device tree needs a budget of at least one node")
    device, depth_limit = logits.device, logits.shape[0]
    width = min(budget, logits.shape[1])
    log_probs, ids = candidate_log_probs(logits, width)  # [D, W]
    slots = torch.arange(budget, device=device)
    # The previous depth's survivors in lexicographic order of their rank paths; depth 0 is the root alone.
    parent_score = torch.full((budget,), float("-inf"), dtype=torch.float64, device=device)
    parent_score[0] = 0.0
    parent_valid = slots == 0
    parent_ranks = torch.full((budget, depth_limit), -1, dtype=torch.long, device=device)
    exact = torch.ones((), dtype=torch.bool, device=device)
    levels = []
    for depth in range(depth_limit):
        # Children in lexicographic order: parents (already in that order), then rank.
        score, exact_here = _exact_sum(parent_score[:, None], log_probs[depth][None, :])  # [budget, W]
        valid = parent_valid[:, None].expand(budget, width)
        exact = exact & (exact_here | ~valid).all()
        score = torch.where(valid, score, float("-inf")).reshape(-1)
        chosen = _first_in_order(score, budget)
        parent_slot, rank = chosen // width, chosen % width
        ranks = parent_ranks[parent_slot].clone()
        ranks[:, depth] = slots  # a node's place among its depth's survivors orders it against its cousins
        parent_score, parent_valid, parent_ranks = score[chosen], valid.reshape(-1)[chosen], ranks
        levels.append((parent_score, parent_valid, ranks, parent_slot, ids[depth][rank], rank))
    score, valid, ranks, parent_slot, tokens, rank = (torch.cat(parts) for parts in zip(*levels, strict=True))
    # Every survivor ranked by (score, rank path), the path compared through its ancestors' places per depth.
    order = torch.arange(score.shape[0], device=device)
    for word in reversed(_lex_words(ranks, budget)):
        order = order[torch.sort(word[order], stable=True).indices]
    order = order[torch.sort(score[order], descending=True, stable=True).indices][:budget]
    # Node i + 1 of the tree is the i-th in that order; a parent's node number is its place in the order.
    node_of = torch.zeros(score.shape[0], dtype=torch.long, device=device)
    node_of[order] = torch.arange(1, budget + 1, device=device)
    level = order // budget  # depth - 1
    parent_id = (level - 1) * budget + parent_slot[order]
    parents = torch.where(level == 0, 0, node_of[parent_id.clamp(min=0)])
    chosen_valid = valid[order]
    depths = torch.where(chosen_valid, level + 1, 1)
    return DeviceTree(
        tokens=torch.cat([root.reshape(1), torch.where(chosen_valid, tokens[order], 0)]),
        parents=torch.cat([parents.new_full((1,), -1), torch.where(chosen_valid, parents, 0)]),
        depths=torch.cat([depths.new_zeros(1), depths]),
        valid=torch.cat([chosen_valid.new_ones(1), chosen_valid]),
        scores=torch.cat([score.new_zeros(1), torch.where(chosen_valid, score[order], float("-inf"))]),
        ranks=torch.cat([rank.new_zeros(1), torch.where(chosen_valid, rank[order], 0)]),
        exact=exact,
    )


def device_chain(root: torch.Tensor, logits: torch.Tensor, length: int) -> DeviceTree:
    """DFlash's chain on the device: the root and the argmax token of each of the first `length` positions
    (ties to the lowest id, as `tree_build.chain_tree`); `length` + 1 nodes, all valid."""
    logits = logits[:length].double()
    picked = logits.argmax(dim=-1)
    log_probs = logits.gather(-1, picked[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    n = length + 1
    device = logits.device
    return DeviceTree(
        tokens=torch.cat([root.reshape(1), picked]),
        parents=torch.arange(-1, n - 1, device=device),
        depths=torch.arange(n, device=device),
        valid=torch.ones(n, dtype=torch.bool, device=device),
        scores=torch.cat([log_probs.new_zeros(1), log_probs.cumsum(0)]),
        ranks=torch.zeros(n, dtype=torch.long, device=device),
        exact=torch.ones((), dtype=torch.bool, device=device),
    )
