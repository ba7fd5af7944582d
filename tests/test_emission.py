"""Tau counts the tokens a decode emits: a stop token ends the count, drafted tokens accepted past it do not
count, for every method, in the reference round and the fixed-shape one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from remote_worker.decoding.emission import emit_round
from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import DecodeResult, decode_from, prefill
from remote_worker.models.loading import load_drafter, load_model, load_tokenizer, model_prompts
from remote_worker.models.target import TargetModel
from remote_worker.prompt_set import load_prompt_file
from remote_worker.prompts import encode
from tests.tiny_models import model_spec

pytestmark = pytest.mark.worker

METHODS = [("ar", 0), ("dflash", 0), ("ddtree", 32)]


def test_a_round_cut_by_a_stop_token_counts_only_what_it_emitted() -> None:
    result = DecodeResult(tokens=[], acceptance_lengths=[])
    assert emit_round(result, [5, 6, 7, 8], [1, 3, 4], [0, 1, 0], 9, frozenset({6}), 100)
    assert result.tokens == [5, 6] and result.acceptance_lengths == [1] and result.tau == 2.0
    assert result.accepted_nodes == [[1]] and result.accepted_ranks == [[0]] and result.tree_sizes == [9]
    whole = DecodeResult(tokens=[], acceptance_lengths=[])
    assert emit_round(whole, [5, 6, 7, 8], [1, 3, 4], [0, 1, 0], 9, frozenset({8}), 100)  # the bonus is the stop
    assert whole.acceptance_lengths == [3] and whole.accepted_nodes == [[1, 3, 4]]
    first = DecodeResult(tokens=[], acceptance_lengths=[])
    assert emit_round(first, [5, 6, 7], [1, 2], [0, 0], 9, frozenset({5}), 100)
    assert first.tokens == [5] and first.acceptance_lengths == [0] and first.tau == 1.0
    limit = DecodeResult(tokens=[1, 2], acceptance_lengths=[1])
    assert emit_round(limit, [5, 6, 7], [1, 2], [0, 0], 9, frozenset(), 3)  # the token limit cuts the same way
    assert limit.tokens == [1, 2, 5] and limit.acceptance_lengths == [1, 0]
    going = DecodeResult(tokens=[], acceptance_lengths=[])
    assert not emit_round(going, [5, 6, 7], [1, 2], [0, 0], 9, frozenset(), 100)
    assert going.acceptance_lengths == [2]


@pytest.fixture(scope="module")
def trained():
    spec = model_spec("tiny_trained", "float32")
    model = load_model(spec, seed=0)
    prompt = load_prompt_file(Path(model_prompts(spec)))[0]
    target = TargetModel(model)
    ids = encode(prompt, load_tokenizer(spec), target.embed.num_embeddings)
    return target, load_drafter(spec, seed=0, target=model), ids


def _decode(trained, method: str, budget: int, stop: frozenset[int], fixed: bool) -> DecodeResult:
    target, drafter, ids = trained
    start = prefill(target, ids, None if method == "ar" else drafter)
    rounds = None
    if fixed:
        rounds = FixedRound(target, method, 1024, drafter=None if method == "ar" else drafter, budget=budget)
    return decode_from(
        target, start, method=method, max_new_tokens=40, drafter=drafter, budget=budget, stop_tokens=stop,
        rounds=rounds,
    )  # fmt: skip


@pytest.mark.parametrize("fixed", [False, True], ids=["reference-round", "fixed-round"])
@pytest.mark.parametrize(("method", "budget"), METHODS)
def test_a_stop_token_ends_taus_count(trained, method: str, budget: int, fixed: bool) -> None:
    """The stop token at the first position (the answer is one token) and in the middle of a deep round."""
    free = _decode(trained, "dflash", 0, frozenset(), fixed=False)
    # A middle stop: a drafted token inside a round that accepted at least 3, its first time in the output,
    # so that the decode stops there with accepted tokens behind it.
    token, at = None, 0
    for accepted in free.acceptance_lengths:
        for offset in range(1, accepted):
            if token is None and accepted >= 3 and free.tokens.index(free.tokens[at + offset]) == at + offset:
                token = free.tokens[at + offset]
        at += accepted + 1
    for stop in (free.tokens[0], token):
        result = _decode(trained, method, budget, frozenset({stop}), fixed)
        assert result.tokens == free.tokens[: free.tokens.index(stop) + 1]
        emitted = sum(a + 1 for a in result.acceptance_lengths)
        assert emitted == len(result.tokens), (stop, result.acceptance_lengths)
        assert [len(nodes) for nodes in result.accepted_nodes] == result.acceptance_lengths
        if stop == free.tokens[0]:
            assert result.tau == 1.0  # one token in one round: tau is 1, never the block size


def test_without_a_stop_the_last_round_counts_what_the_limit_let_out(trained) -> None:
    result = _decode(trained, "ddtree", 32, frozenset(), fixed=False)
    assert sum(a + 1 for a in result.acceptance_lengths) == len(result.tokens) == 40
    assert torch.is_tensor(trained[2])
