"""A tree budget the device cannot hold is refused before any decode, in one line that says what it needs.

The count is tied to the tensors a real verify keeps (on the Qwen3.6-27B twin: 16 GDN key heads, 48 value
heads), so it cannot drift from the cache it describes."""

from __future__ import annotations

import pytest
import torch

from remote_worker.decoding.tree_memory import GIB, budget_problem, largest_budget, tree_memory
from remote_worker.probes.hybrid_cache_check import random_tree
from tests.test_twins import VOCAB, prompt, target_twin

pytestmark = pytest.mark.worker


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_gdn_part_is_what_a_verify_keeps_for_its_commit(dtype: str) -> None:
    target = target_twin("Qwen3.6-27B", dtype)
    cache = target.new_cache()
    context = prompt(0, 12)
    target.prefill(cache, context)
    nodes = 9
    target.verify(cache, random_tree(nodes, VOCAB - 1, torch.Generator().manual_seed(1)))
    kept = sum(
        p.keys.numel() * p.keys.element_size()
        + p.result.u.numel() * p.result.u.element_size()
        + p.extended.numel() * p.extended.element_size()
        for p in cache.pending
        if p is not None
    )
    assert kept > 0
    assert tree_memory(target, nodes, len(context)).gdn_kept == kept


def test_a_budget_too_large_for_the_memory_is_one_line_naming_what_fits() -> None:
    target = target_twin("Qwen3.6-27B", "float32")
    free, context = 2 * GIB, 4096
    problem = budget_problem(target, 100_000, context, free)
    assert problem is not None and "\n" not in problem
    fits = largest_budget(target, context, free)
    assert problem.startswith("decode.tree_budgets: budget 100000 needs at least ")
    assert problem.endswith(f"more than the 2.0 GiB free on cpu; the largest budget that fits is {fits}")
    assert "GDN states kept for the commit" in problem and "one layer's scratch" in problem and "logits" in problem
    assert 16 <= fits < 100_000  # the paper's budgets fit in 2 GiB at this twin's widths
    assert budget_problem(target, fits, context, free) is None
    assert budget_problem(target, fits + 1, context, free) is not None
    assert budget_problem(target, 100_000, context, None) is None  # nothing known: nothing refused
