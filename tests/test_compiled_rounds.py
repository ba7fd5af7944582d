"""Compiled fixed-shape rounds on more models: the compiled prefill and DDTree round emit AR's tokens.

Compiling takes a minute or two per model on a CPU, so these are `slow` tests of `make test` only; the oldest
supported transformers (`make test-compat`) compiles one model, in `tests/test_fixed_round.py`."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from remote_worker.decoding.fixed_prefill import FixedPrefill
from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import decode, decode_from, fixed_capacity, prefill
from tests.tiny_models import random_prompt, tiny


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,dtype",
    # tiny_hybrid in float32 is `test_the_compiled_round_is_one_graph_compiled_once`; the Qwen3.6-27B twin has
    # the real head layout (16 GDN key heads, 48 value heads) and a windowed five-layer drafter
    [("tiny_hybrid", "float64"), ("tiny_dense", "float32"), ("Qwen3.6-27B-DFlash", "float32")],
)
def test_compiled_rounds_emit_ar_tokens(name: str, dtype: str) -> None:
    """The compiled prefill and DDTree round (fullgraph: a break is an error) decode two prompts exactly as AR
    does; the second compiles nothing."""
    if name.startswith("tiny"):
        target, draft = tiny(name, dtype)
        prompts = [random_prompt(4), random_prompt(11)]
    else:
        from tests.test_twins import CASES, draft_twin, prompt, target_twin

        target, draft = target_twin(CASES[name].target.name, dtype), draft_twin(name, dtype)
        prompts = [prompt(1, 9), prompt(2, 14)]
    capacity = fixed_capacity(max(p.shape[0] for p in prompts), 10, draft.block_size, 8)
    rounds = FixedRound(target, "ddtree", capacity, drafter=draft, budget=8)
    prefiller = FixedPrefill(target, 256, 8, draft.feature_layers)
    rounds.compile()
    prefiller.compile()
    graphs = []
    for prompt_tokens in prompts:
        start = prefill(target, prompt_tokens, draft, prefiller)
        result = decode_from(target, start, method="ddtree", max_new_tokens=10, drafter=draft, budget=8, rounds=rounds)
        assert result.tokens == decode(target, prompt_tokens, method="ar", max_new_tokens=10).tokens
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]
