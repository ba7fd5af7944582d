"""At temperature 0, DFlash and DDTree emit exactly the tokens AR emits, on hybrid and dense models."""

from __future__ import annotations

import pytest

from remote_worker.decoding.loop import decode
from tests.teacher_drafter import TeacherDrafter
from tests.tiny_models import TINY_MODELS, random_prompt, tiny

pytestmark = pytest.mark.worker  # also run under the oldest supported transformers (make test-compat)

SEEDS = range(20)
BUDGETS = (1, 4, 16, 64, 256)
NEW_TOKENS = 24


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_speculative_decoding_is_lossless(name: str, dtype: str) -> None:
    target, draft = tiny(name, dtype)
    accepted_deep = 0
    for seed in SEEDS:
        prompt = random_prompt(seed)
        ar = decode(target, prompt, method="ar", max_new_tokens=NEW_TOKENS)
        assert len(ar.tokens) == NEW_TOKENS and ar.tau == 1.0
        teacher = TeacherDrafter(prompt.tolist() + ar.tokens, 512, draft.block_size, seed)
        for drafter in (draft, teacher):
            dflash = decode(target, prompt, method="dflash", max_new_tokens=NEW_TOKENS, drafter=drafter)
            assert dflash.tokens == ar.tokens, (seed, "dflash", type(drafter).__name__)
            for budget in BUDGETS:
                tree = decode(
                    target, prompt, method="ddtree", max_new_tokens=NEW_TOKENS, drafter=drafter, budget=budget
                )
                assert tree.tokens == ar.tokens, (seed, budget, type(drafter).__name__)
                assert max(tree.tree_sizes) <= budget + 1
                if drafter is teacher and budget >= 16:
                    accepted_deep += max(tree.acceptance_lengths) >= 3
    # The teacher makes the loops commit multi-token paths through every layer type; make sure they did.
    assert accepted_deep >= len(SEEDS) * 3 // 2


def test_stop_tokens_end_the_output_at_the_same_place() -> None:
    target, draft = tiny("tiny_hybrid")
    prompt = random_prompt(3)
    full = decode(target, prompt, method="ar", max_new_tokens=NEW_TOKENS)
    stop = full.tokens[10]
    expected = full.tokens[: full.tokens.index(stop) + 1]
    teacher = TeacherDrafter(prompt.tolist() + full.tokens, 512, draft.block_size, seed=3, hit_rate=1.0)
    for method, budget in (("ar", 0), ("dflash", 0), ("ddtree", 16)):
        drafter = None if method == "ar" else teacher
        out = decode(
            target,
            prompt,
            method=method,
            max_new_tokens=NEW_TOKENS,
            drafter=drafter,
            budget=budget,
            stop_tokens=frozenset({stop}),
        )
        assert out.tokens == expected, method


def test_teacher_makes_ddtree_accept_more_than_dflash() -> None:
    """A tree covers ranks a chain misses: the reason DDTree exists."""
    target, draft = tiny("tiny_hybrid")
    prompt = random_prompt(5)
    ar = decode(target, prompt, method="ar", max_new_tokens=48)
    teacher = TeacherDrafter(prompt.tolist() + ar.tokens, 512, draft.block_size, seed=5)
    dflash = decode(target, prompt, method="dflash", max_new_tokens=48, drafter=teacher)
    ddtree = decode(target, prompt, method="ddtree", max_new_tokens=48, drafter=teacher, budget=64)
    assert ddtree.tau > dflash.tau > 1.0
