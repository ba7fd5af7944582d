"""The share of rounds that only repeat a short loop, which tells a real tau from a degenerate one."""

from __future__ import annotations

import pytest

from remote_worker.decoding.comparison import repetition_flags

pytestmark = pytest.mark.worker


def test_a_loop_and_a_whitespace_run_count_and_new_text_does_not() -> None:
    prompt = list(b"x = [")
    tokens = list(b"1, 2, 1, 2, 1, 2") + list(b"\n    ") + list(b"    ") + list(b"done")
    # Rounds: "1, 2, " (new), "1, 2, 1, 2" (period 6), "\n    " (new), "    " (period 1), "done" (new).
    assert repetition_flags(prompt, tokens, [5, 9, 4, 3, 3]) == [False, True, False, True, False]


def test_a_round_truncated_by_max_new_tokens_is_judged_on_what_it_committed() -> None:
    assert repetition_flags(list(b"ab"), list(b"abab"), [1, 3]) == [True, True]
    assert repetition_flags(list(b"ab"), list(b"cd"), [5]) == [False]


def test_periods_longer_than_the_limit_are_not_repetition() -> None:
    prompt = list(range(20))
    assert repetition_flags(prompt, list(range(20)), [19], max_period=16) == [False]
    assert repetition_flags(prompt, list(range(20)), [19], max_period=20) == [True]
