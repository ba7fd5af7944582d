"""The lossless check the exactness suites share: at temperature 0, DFlash and DDTree emit AR's tokens."""

from __future__ import annotations

import torch

from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import decode, decode_from, fixed_capacity, prefill
from remote_worker.decoding.online_budget import WARMUP_ROUNDS, OnlineBudget
from remote_worker.decoding.online_round import OnlineRound
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
    fixed: bool = True,
    online: bool = True,
) -> int:
    """AR decodes `prompt`; then DFlash and DDTree at every budget, with `draft` (when there is one) and with a
    teacher that knows AR's continuation, must emit exactly AR's tokens, trees never past their budget; and
    so must the fixed-shape rounds on the device (`fixed_round`), accepting what the reference round accepts
    (unless `fixed` is False); and so must `ddtree_online` (unless `online` is False), on the reference round
    and, with the teacher, on its fixed-shape round (`online_round`).
    Returns how many teacher runs at a budget of at least `deep_budget` committed a path of 3 tokens or more
    (the teacher is there to make long paths commit through every layer kind; callers check it did)."""
    ar = decode(target, prompt, method="ar", max_new_tokens=new_tokens)
    assert len(ar.tokens) == new_tokens and ar.tau == 1.0
    capacity = fixed_capacity(prompt.shape[0], new_tokens, block_size, max(budgets))
    if fixed:
        rounds = FixedRound(target, "ar", capacity)
        fixed_ar = decode_from(target, prefill(target, prompt), method="ar", max_new_tokens=new_tokens, rounds=rounds)
        assert fixed_ar.tokens == ar.tokens, (seed, "fixed ar")
    teacher = TeacherDrafter(prompt.tolist() + ar.tokens, vocab, block_size, seed)
    deep = 0
    for drafter in (d for d in (draft, teacher) if d is not None):
        start = prefill(target, prompt, drafter)
        name = type(drafter).__name__
        for method, budget in (("dflash", 0), *(("ddtree", b) for b in budgets)):
            options = {"method": method, "max_new_tokens": new_tokens, "drafter": drafter, "budget": budget}
            reference = decode_from(target, start, **options)
            assert reference.tokens == ar.tokens, (seed, method, budget, name)
            assert method == "dflash" or max(reference.tree_sizes) <= budget + 1
            if drafter is teacher and method == "ddtree" and budget >= deep_budget:
                deep += max(reference.acceptance_lengths) >= 3
            if fixed:
                rounds = FixedRound(target, method, capacity, drafter=drafter, budget=budget)
                result = decode_from(target, start, **options, rounds=rounds)
                assert result.tokens == ar.tokens, (seed, "fixed", method, budget, name)
                if not result.inexact_trees:  # the host heap's trees: the same paths are accepted
                    assert result.acceptance_lengths == reference.acceptance_lengths, (seed, method, budget, name)
        # ddtree_online: each round verifies the first n nodes of the largest budget's tree, n chosen among the
        # budgets from the draft's confidence (the history taken as warm: the choice works from the first round)
        if not online:
            continue
        policy = OnlineBudget(max(budgets), tuple(sorted(set(budgets))), min(budgets), lambda n: 1 + n / 16)
        policy.calibration.rounds = WARMUP_ROUNDS
        result = decode_from(target, start, method="ddtree", max_new_tokens=new_tokens, drafter=drafter,
                             budget=max(budgets), online=policy)  # fmt: skip
        assert result.tokens == ar.tokens, (seed, "ddtree_online", name)
        assert {size - 1 for size in result.tree_sizes} <= set(budgets), (seed, "ddtree_online", name)
        if fixed and drafter is teacher:  # and on its fixed-shape round (`online_round`), whose paths commit deep
            policy = OnlineBudget(max(budgets), tuple(sorted(set(budgets))), min(budgets), lambda n: 1 + n / 16)
            policy.calibration.rounds = WARMUP_ROUNDS
            rounds = OnlineRound(target, capacity, drafter=drafter, policy=policy)
            result = decode_from(target, start, method="ddtree", max_new_tokens=new_tokens, drafter=drafter,
                                 budget=max(budgets), rounds=rounds)  # fmt: skip
            assert result.tokens == ar.tokens, (seed, "ddtree_online fixed", name)
            assert {size - 1 for size in result.tree_sizes} <= set(budgets), (seed, "ddtree_online fixed", name)
    return deep
