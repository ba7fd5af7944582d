"""The lossless check the exactness suites share: at temperature 0, DFlash and DDTree emit AR's tokens."""

from __future__ import annotations

import torch

from remote_worker.decoding.loop import decode
from remote_worker.models.target import TargetModel
from tests.teacher_drafter import TeacherDrafter


def assert_lossless(
    target: TargetModel,
    prompt: torch.Tensor,
    draft: object | None,
    budgets: tuple[int, ...],
    new_tokens: int,
    seed: int,
    vocab: int,
    block_size: int,
    deep_budget: int,
) -> int:
    """AR decodes `prompt`; then DFlash and DDTree at every budget, with `draft` (when there is one) and with a
    teacher that knows AR's continuation, must emit exactly AR's tokens, trees never past their budget.
    Returns how many teacher runs at a budget of at least `deep_budget` committed a path of 3 tokens or more
    (the teacher is there to make long paths commit through every layer kind; callers check it did)."""
    ar = decode(target, prompt, method="ar", max_new_tokens=new_tokens)
    assert len(ar.tokens) == new_tokens and ar.tau == 1.0
    teacher = TeacherDrafter(prompt.tolist() + ar.tokens, vocab, block_size, seed)
    deep = 0
    for drafter in (d for d in (draft, teacher) if d is not None):
        dflash = decode(target, prompt, method="dflash", max_new_tokens=new_tokens, drafter=drafter)
        assert dflash.tokens == ar.tokens, (seed, "dflash", type(drafter).__name__)
        for budget in budgets:
            tree = decode(target, prompt, method="ddtree", max_new_tokens=new_tokens, drafter=drafter, budget=budget)
            assert tree.tokens == ar.tokens, (seed, budget, type(drafter).__name__)
            assert max(tree.tree_sizes) <= budget + 1
            if drafter is teacher and budget >= deep_budget:
                deep += max(tree.acceptance_lengths) >= 3
    return deep
