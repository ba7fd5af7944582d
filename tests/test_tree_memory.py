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
    need = tree_memory(target, nodes, len(context))
    assert need.gdn_kept == kept
    # The masks the round holds through every layer, and the tree's K/V in the cache: the same bytes.
    ctx = cache.context
    masks = (ctx.mask, ctx.ancestors, ctx.decay_bias, ctx.attention_bias)
    assert need.masks == sum(t.numel() * t.element_size() for t in masks)
    assert cache.kv is not None
    tree_kv = cache.kv[:, :, :, len(context) : len(context) + nodes]
    assert need.attention_kv == tree_kv.numel() * tree_kv.element_size()
    logits = target.verify(cache, random_tree(nodes, VOCAB - 1, torch.Generator().manual_seed(2))).logits
    assert need.logits == logits.numel() * logits.element_size()  # the model's dtype, not float32


def test_a_budget_too_large_for_the_memory_is_one_line_naming_what_fits() -> None:
    target = target_twin("Qwen3.6-27B", "float32")
    free, context = 2 * GIB, 4096
    problem = budget_problem(target, 100_000, context, free)
    assert problem is not None and "\n" not in problem
    fits = largest_budget(target, context, free)
    assert problem.startswith("decode.tree_budgets: budget 100000 needs at least ")
    assert problem.endswith(f"more than the 2.0 GiB free on cpu; the largest budget that fits is {fits}")
    need = tree_memory(target, 100_001, context)
    assert f"needs at least {need.total / GIB:.1f} GiB for one tree at 4096 tokens of context (" in problem
    # Named parts that add up to the total: what every layer holds, then the largest one-step scratch.
    parts = ["tree masks", "tree K/V", "GDN states kept for the commit", "one GDN layer's scratch"]
    assert [p.rsplit(" ", 1)[0] for p in problem.split(" (", 1)[1].split(" GiB)")[0].split(", ")] == parts
    assert need.gdn_layer > max(need.attention_layer, need.logits)  # 48 value heads × n² beat 24 heads × n·4k
    assert need.total == need.masks + need.attention_kv + need.gdn_kept + need.gdn_layer
    assert 16 <= fits < 100_000  # the paper's budgets fit in 2 GiB at this twin's widths
    assert budget_problem(target, fits, context, free) is None
    assert budget_problem(target, fits + 1, context, free) is not None
    assert budget_problem(target, 100_000, context, None) is None  # nothing known: nothing refused
