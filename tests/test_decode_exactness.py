"""At temperature 0, DFlash and DDTree emit exactly the tokens AR emits, on hybrid and dense models."""

from __future__ import annotations

import pytest

from remote_worker.decoding.loop import decode
from tests.lossless import assert_lossless
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
    accepted_deep = sum(
        # the fixed-shape rounds on every other seed: they double the decoding, and ten seeds cover them; the
        # per-round budget (`ddtree_online`) on every fourth (every twin decodes it on each of its seeds)
        assert_lossless(
            target,
            random_prompt(seed),
            draft,
            BUDGETS,
            NEW_TOKENS,
            seed,
            512,
            draft.block_size,
            16,
            seed % 2 == 0,
            seed % 4 == 0,
        )
        for seed in SEEDS
    )
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
