"""The worker's figures on tiny_hybrid: tree-against-chain verify cost and the commit share of a DDTree round.

1. Verify cost: a DDTree-shaped tree of N nodes against a chain of N tokens (N = 16, 64) after a 128-token
   prefill; the two are timed alternately so machine noise hits both alike.
2. Commit share: the share of a DDTree round (draft, tree build, verify, commit) spent in commit.
"""

from __future__ import annotations

import statistics
import time

import torch

from remote_worker.cache.tree import Tree
from remote_worker.decoding.loop import decode
from remote_worker.decoding.tree_build import best_first_tree
from remote_worker.models.loading import load_drafter, load_model
from remote_worker.models.target import TargetModel
from remote_worker.prompt_set import DEFAULT_PROMPTS, load_prompt_file
from remote_worker.prompts import encode
from tests.tiny_models import model_spec


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def verify_cost(target: TargetModel, nodes: int, repeats: int, seed: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(seed)
    vocab = target.embed.num_embeddings
    cache = target.new_cache()
    target.prefill(cache, torch.randint(0, vocab, (128,), generator=generator))
    chain = Tree.chain(torch.randint(0, vocab, (nodes,), generator=generator))
    # A tree shaped like DDTree's: best-first over peaked per-position distributions, 15 positions deep.
    log_probs = torch.log_softmax(torch.randn(15, vocab, generator=generator) * 3, dim=-1)
    tree = best_first_tree(int(chain.tokens[0]), log_probs, budget=nodes - 1).tree
    assert tree.size == chain.size == nodes
    chain_times, tree_times = [], []
    for _ in range(3):  # warm-up
        target.verify(cache, chain)
        target.verify(cache, tree)
    for _ in range(repeats):
        chain_times.append(timed(lambda: target.verify(cache, chain)))
        tree_times.append(timed(lambda: target.verify(cache, tree)))
    chain_ms, tree_ms = 1000 * statistics.median(chain_times), 1000 * statistics.median(tree_times)
    return {
        "nodes": nodes,
        "tree_depth": int(tree.depths.max()),
        "chain_ms": chain_ms,
        "tree_ms": tree_ms,
        "tree_over_chain": tree_ms / chain_ms,
    }


def commit_share(name: str, budget: int, repeats: int) -> dict[str, float]:
    spec = model_spec(name, "float32")
    model = load_model(spec, seed=0)
    target, drafter = TargetModel(model), load_drafter(spec, seed=0, target=model)
    prompts = [encode(p, None, target.embed.num_embeddings) for p in load_prompt_file(DEFAULT_PROMPTS)]
    shares, commit_ms = [], []
    for _ in range(repeats):
        stages = dict.fromkeys(("draft", "tree_build", "verify", "commit"), 0.0)
        rounds = 0
        for prompt in prompts:
            result = decode(target, prompt, method="ddtree", max_new_tokens=48, drafter=drafter, budget=budget)
            for stage, seconds in result.stage_seconds.items():
                stages[stage] += seconds
            rounds += result.rounds
        shares.append(stages["commit"] / sum(stages.values()))
        commit_ms.append(1000 * stages["commit"] / rounds)
    return {
        "model": name,
        "tree_budget": budget,
        "commit_share": statistics.median(shares),
        "commit_ms_per_round": statistics.median(commit_ms),
    }


def worker_figures(repeats: int) -> dict:
    spec = model_spec("tiny_hybrid", "float32")
    target = TargetModel(load_model(spec, seed=0))
    return {
        "verify_cost": [verify_cost(target, n, repeats, seed=n) for n in (16, 64)],
        "commit_share": commit_share("tiny_hybrid", budget=32, repeats=max(3, repeats // 10)),
    }
