"""The hybrid-aware cache checked on the real model: tree verification and commit against recomputation.

After a prefill, a random tree is verified; every node's logits are compared with a fresh prefill of the
prefix plus that node's root path. Then a random root path is committed and the next token verified; its
logits are compared with a fresh prefill of the same tokens. The two evaluations sum in different orders,
so even an exact cache differs by rounding: each difference is judged against `rounding.model_bound`, the
most that rounding in the model's dtype can explain at these logits' scale. (A difference is a few machine
epsilons of the largest logit: a trained model's logits of ten or more differ ten times as much as a random
tiny model's, below one, with the cache just as exact; hence a bound relative to the scale, not a number.)
"""

from __future__ import annotations

from typing import Any

import torch

from remote_worker.cache.tree import Tree
from remote_worker.models.rounding import model_bound
from remote_worker.models.target import TargetModel


def random_tree(size: int, vocab: int, generator: torch.Generator) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]
    return Tree.from_parents(torch.randint(0, vocab, (size,), generator=generator), parents)


def _fresh_last_logits(target: TargetModel, tokens: torch.Tensor) -> torch.Tensor:
    cache = target.new_cache()
    if tokens.shape[0] > 1:
        target.prefill(cache, tokens[:-1])
    return target.verify(cache, Tree.chain(tokens[-1:])).logits[-1].double()


def check_hybrid_cache(target: TargetModel, prefix: torch.Tensor, tree_size: int, seed: int) -> dict[str, Any]:
    vocab = target.embed.num_embeddings
    generator = torch.Generator().manual_seed(seed)
    tree = random_tree(tree_size, vocab, generator)
    prefix = prefix.to(target.device)
    cache = target.new_cache()
    target.prefill(cache, prefix)
    verified = target.verify(cache, tree).logits.double()
    tree_tokens = tree.tokens.to(target.device)
    tree_error, scale = 0.0, 0.0
    for node in range(tree.size):
        path = tree.path_to(node)
        fresh = _fresh_last_logits(target, torch.cat([prefix, tree_tokens[path]]))
        tree_error = max(tree_error, float((verified[node] - fresh).abs().max()))
        scale = max(scale, float(fresh.abs().max()))
    last = int(torch.randint(0, tree.size, (1,), generator=generator))
    path = tree.path_to(last)
    cache.commit(path)
    next_token = torch.randint(0, vocab, (1,), generator=generator).to(target.device)
    continued = target.verify(cache, Tree.chain(next_token)).logits[-1].double()
    fresh = _fresh_last_logits(target, torch.cat([prefix, tree_tokens[path], next_token]))
    commit_error = float((continued - fresh).abs().max())
    scale = max(scale, float(fresh.abs().max()))
    # The longest sequence either side solves: the tree, or a fresh prefill of the prefix and a whole path.
    bound = model_bound(target, scale, max(tree.size, prefix.shape[0] + tree.depth + 2))
    return {
        "tree_size": tree.size,
        "committed_path_length": len(path),
        "tree_verify_max_abs_diff": tree_error,
        "commit_logits_max_abs_diff": commit_error,
        "logits_scale": scale,
        "rounding_bound": bound,
        "exact": verdict(max(tree_error, commit_error), bound, scale, target.dtype),
    }


def verdict(error: float, bound: float, scale: float, dtype: torch.dtype) -> str:
    """Whether the differences are rounding, in words: `yes` within the bound, `NO` beyond it, and no verdict
    where the bound is as large as the logits themselves (bfloat16, float16: rounding could explain anything)."""
    if bound >= max(scale, 1.0):
        return f"cannot tell in {str(dtype).removeprefix('torch.')}: probe in float32"
    if error <= bound:
        return "yes"
    return f"NO: {error:.3g} > {bound:.3g}"
