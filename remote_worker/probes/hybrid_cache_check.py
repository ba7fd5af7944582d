"""The hybrid-aware cache checked on the real model: tree verification and commit against recomputation.

After a prefill, a random tree is verified; every node's logits are compared with a fresh prefill of the
prefix plus that node's root path. Then a random root path is committed and the next token verified; its
logits are compared with a fresh prefill of the same tokens. Both differences are ~0 when the cache is exact.
"""

from __future__ import annotations

from typing import Any

import torch

from remote_worker.cache.tree import Tree
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
    tree_error = 0.0
    for node in range(tree.size):
        path = tree.path_to(node)
        fresh = _fresh_last_logits(target, torch.cat([prefix, tree_tokens[path]]))
        tree_error = max(tree_error, float((verified[node] - fresh).abs().max()))
    last = int(torch.randint(0, tree.size, (1,), generator=generator))
    path = tree.path_to(last)
    cache.commit(path)
    next_token = torch.randint(0, vocab, (1,), generator=generator).to(target.device)
    continued = target.verify(cache, Tree.chain(next_token)).logits[-1].double()
    fresh = _fresh_last_logits(target, torch.cat([prefix, tree_tokens[path], next_token]))
    return {
        "tree_size": tree.size,
        "committed_path_length": len(path),
        "tree_verify_max_abs_diff": tree_error,
        "commit_logits_max_abs_diff": float((continued - fresh).abs().max()),
    }
