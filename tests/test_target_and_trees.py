"""The target's own forward through the hybrid-aware cache, tree verification and commit, and tree building."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_worker.cache.tree import Tree
from remote_worker.decoding.tree_build import best_first_tree, chain_tree, ranked_candidates, top_candidates
from remote_worker.probes.hybrid_cache_check import check_hybrid_cache
from tests.rounding import model_bound, own_forward_bound
from tests.tiny_models import TINY_MODELS, random_prompt, tiny

# worker: only the worker's dependencies; compat: it touches transformers, so `make test-compat` runs it
# under the oldest supported release too
pytestmark = [pytest.mark.worker, pytest.mark.compat]


@pytest.mark.parametrize("name", TINY_MODELS)
def test_forward_through_the_cache_matches_the_model(name: str) -> None:
    """Prefill in chunks plus single steps gives the logits of the model's own forward over the sequence."""
    target, _ = tiny(name, "float32")
    tokens = random_prompt(7, 512).repeat(4)[:40]
    with torch.no_grad():
        reference = target.model(tokens[None]).logits[0].double()
    cache = target.new_cache()
    target.prefill(cache, tokens[:30], chunk=7)
    steps = []
    for token in tokens[30:]:
        steps.append(target.verify(cache, Tree.chain(token[None])).logits[0].double())
        cache.commit([0])
    assert (torch.stack(steps) - reference[30:]).abs().max() <= own_forward_bound(target, 1.0, 40)
    assert cache.length == 40


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_tree_verify_and_commit_equal_recomputation(name: str, dtype: str) -> None:
    """float64 computes in float64 throughout (norms and routing included), so two evaluations differ by
    float64 roundings only: the bound is derived from the arithmetic (tests/rounding.py), not from a CPU."""
    target, _ = tiny(name, dtype)
    tolerance = model_bound(target, scale=1.0, tree_size=20)
    for seed in range(3):
        report = check_hybrid_cache(target, random_prompt(seed), tree_size=20, seed=seed)
        assert report["tree_verify_max_abs_diff"] < tolerance, report
        assert report["commit_logits_max_abs_diff"] < tolerance, report


def test_commit_rejects_a_path_that_is_not_in_the_tree() -> None:
    target, _ = tiny("tiny_hybrid")
    cache = target.new_cache()
    target.verify(cache, Tree.from_parents(torch.tensor([1, 2, 3]), [-1, 0, 0]))
    with pytest.raises(ValueError, match="not a root path"):
        cache.commit([0, 1, 2])
    assert cache.length == 0


def all_prefix_scores(log_probs: torch.Tensor, width: int) -> list[float]:
    """Brute force: the score of every (rank at depth 1, ..., rank at depth d) choice, all depths."""
    values = log_probs.double().topk(width, dim=-1).values
    scores = []
    for depth in range(1, log_probs.shape[0] + 1):
        for ranks in itertools.product(range(width), repeat=depth):
            scores.append(sum(values[d, r].item() for d, r in enumerate(ranks)))
    return sorted(scores, reverse=True)


@settings(max_examples=40, deadline=None)
@given(
    depth=st.integers(1, 3),
    vocab=st.integers(2, 5),
    budget=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_best_first_tree_holds_the_highest_scoring_nodes(depth: int, vocab: int, budget: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(depth, vocab, generator=generator, dtype=torch.float64) * 3, dim=-1)
    draft = best_first_tree(root=7, logits=log_probs, budget=budget)
    tree = draft.tree
    expected = all_prefix_scores(log_probs, min(budget, vocab))[:budget]
    assert tree.size - 1 == len(expected)
    assert sorted(draft.scores[1:], reverse=True) == pytest.approx(expected)
    assert draft.scores[1:] == sorted(draft.scores[1:], reverse=True), "nodes come out in score order"
    for node in range(1, tree.size):
        parent = int(tree.parents[node])
        assert parent < node, "topological order"
        assert draft.children[parent][int(tree.tokens[node])] == node
        expected_score = draft.scores[parent] + log_probs[int(tree.depths[node]) - 1, int(tree.tokens[node])].item()
        assert math.isclose(draft.scores[node], expected_score, rel_tol=1e-9, abs_tol=1e-9)
    assert int(tree.depths.max()) <= depth


def test_chain_tree_takes_the_argmax_at_every_position() -> None:
    log_probs = torch.log_softmax(torch.randn(5, 11, generator=torch.Generator().manual_seed(0)), dim=-1)
    draft = chain_tree(root=3, logits=log_probs, length=5)
    assert draft.tree.tokens.tolist() == [3, *log_probs.argmax(-1).tolist()]
    assert draft.tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]


def reference_order(logits: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """The paper's pop order written out: every rank path scored, sorted by (-score, rank path)."""
    width = min(budget, logits.shape[1])
    top_logits, _ = torch.topk(logits.float(), k=width, dim=-1)
    log_probs = (top_logits - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).tolist()
    paths = [
        ranks for depth in range(1, logits.shape[0] + 1) for ranks in itertools.product(range(width), repeat=depth)
    ]

    def score(ranks: tuple[int, ...]) -> float:
        return sum(log_probs[d][r] for d, r in enumerate(ranks))

    return sorted(paths, key=lambda ranks: (-round(score(ranks), 5), ranks))[:budget]


def test_tied_scores_pop_in_the_papers_order() -> None:
    """bfloat16 logits tie often: equal scores pop by rank path, as in the paper's heap, never by push order."""
    logits = torch.tensor([[2.0, 2.0, 2.0, -9.0], [1.0, 1.0, -9.0, -9.0], [0.5, 0.5, 0.5, -9.0]]).to(torch.bfloat16)
    for budget in (3, 5, 8, 12):
        draft = best_first_tree(root=0, logits=logits.float(), budget=budget)
        ranks_of = {0: ()}
        paths = []
        for node in range(1, draft.tree.size):
            parent, depth = int(draft.tree.parents[node]), int(draft.tree.depths[node])
            rank = draft.ranks[node]
            # equal logits rank by token id: the rank-r candidate is the r-th best by (logit, id)
            ranked = sorted(range(logits.shape[1]), key=lambda t, d=depth: (-float(logits[d - 1, t]), t))
            assert int(draft.tree.tokens[node]) == ranked[rank]
            ranks_of[node] = (*ranks_of[parent], rank)
            paths.append(ranks_of[node])
        assert paths == reference_order(logits, budget), budget
    # Before the paper's rule, ties popped in push order: (1,) then (0, 0) and (1, 0) before (0, 1).
    draft = best_first_tree(root=0, logits=logits.float(), budget=5)
    assert [int(d) for d in draft.tree.depths] == [0, 1, 1, 1, 2, 2]
    assert [int(p) for p in draft.tree.parents] == [-1, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("kind", ["distinct", "bfloat16", "integers"])
def test_the_fast_candidates_are_the_tie_rules_candidates(kind: str) -> None:
    """`top_candidates` takes `topk`'s own order where a row has no tie at its top, and the tie rule's
    (`ranked_candidates`) elsewhere: the same ids in the same order and the same log-probabilities as the rule
    gives every row, with few ties (float32), many (bfloat16) or nearly only ties (small integers)."""
    generator = torch.Generator().manual_seed(5)
    for case in range(30):
        vocab = (17, 64, 300)[case % 3]
        logits = torch.randn(9, vocab, generator=generator) * (1 + case % 5)
        if kind == "bfloat16":
            logits = logits.bfloat16()
        elif kind == "integers":
            logits = logits.round().clamp(-3, 3)
        for width in (1, 4, 16, vocab):
            log_probs, ids = top_candidates(logits, width)
            values, rule_ids = ranked_candidates(logits.float(), width)
            rule_log_probs = values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
            assert ids == rule_ids.tolist(), (kind, case, width)
            assert log_probs == rule_log_probs.tolist(), (kind, case, width)
