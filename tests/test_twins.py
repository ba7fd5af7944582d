"""The exactness suite on a shape-faithful twin of every published model (`remote_worker.models.twins`).

Each config in remote_worker/data/model_configs/ becomes a case here with no code of its own: a target
twin, decoded with its draft's twin (and with the teacher drafter, which makes long paths get accepted).
At float32 and float64: the logits through the cache equal the model's own forward, in every prefill chunk
size; tree verification and commit equal recomputation; the committed GDN state equals the model's own
recurrence; DFlash and DDTree emit exactly AR's tokens.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from remote_worker.cache.tree import Tree
from remote_worker.models.dflash import DFlashDraft, build_draft
from remote_worker.models.layout import DraftLayout, TargetLayout, published
from remote_worker.models.loading import load_model
from remote_worker.models.mixers import GDNMixer
from remote_worker.models.target import TargetModel
from remote_worker.models.twins import VOCAB, TwinCase, TwinTarget, kept_counts, twin_cases
from remote_worker.probes.hybrid_cache_check import check_hybrid_cache, random_tree
from remote_worker.spec import ModelSpec
from tests.lossless import assert_lossless
from tests.rounding import model_bound, own_forward_bound

# worker: only the worker's dependencies. compat (on each test that reads transformers' models: the layouts, the
# models' own forward and recurrence): `make test-compat` runs those under the oldest supported release too. The
# lossless decodes run our loops on weights those tests have already read, so they run once, in `make test`.
pytestmark = pytest.mark.worker

CASES = {case.id: case for case in twin_cases()}
TARGETS = {case.target.name: case.target for case in CASES.values()}
# the same twins at the published depth (64 layers for the 27B models, 48 for Qwen3-Next)
FULL_CASES = {case.id: case for case in twin_cases(full_depth=True)}
FULL_TARGETS = {case.target.name: case.target for case in FULL_CASES.values()}
DTYPES = ("float32", "float64")


@cache
def target_twin(name: str, dtype: str, full_depth: bool = False) -> TargetModel:
    twin = (FULL_TARGETS if full_depth else TARGETS)[name]
    spec = ModelSpec(name, "config", twin.arch, dtype, "cpu", twin.config, None)
    return TargetModel(load_model(spec, seed=0))


@cache
def draft_twin(case_id: str, dtype: str, full_depth: bool = False) -> DFlashDraft | None:
    draft = (FULL_CASES if full_depth else CASES)[case_id].draft
    return None if draft is None else build_draft(draft.config, 1, getattr(torch, dtype), torch.device("cpu"))


def prompt(seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(20_000 + seed)
    return torch.randint(0, VOCAB - 1, (length,), generator=generator)


@pytest.mark.compat
def test_every_published_config_is_a_case() -> None:
    named = {case.target.name for case in CASES.values()} | {c.draft.name for c in CASES.values() if c.draft}
    assert named == set(published())


@pytest.mark.compat
@pytest.mark.parametrize("case_id", CASES)
def test_the_twin_keeps_the_published_layout(case_id: str) -> None:
    """The counts the worker's shapes depend on are the published model's, in the config and in the built
    modules; the widths are small and equal none of those counts."""
    case = CASES[case_id]
    twin = case.target
    assert twin.layout == TargetLayout.of(published()[twin.name])
    target = target_twin(twin.name, "float32")
    assert TargetLayout.of(target.model.config.get_text_config().to_dict()) == twin.layout
    for mixer in target.mixers:
        if isinstance(mixer, GDNMixer):
            assert mixer.heads[:2] == twin.layout.gdn_heads
        else:
            assert (mixer.heads, mixer.kv_heads) == twin.layout.attention_heads
            gated = mixer.qkv.sizes[0] == 2 * mixer.heads * mixer.head_dim
            assert gated == twin.layout.gated_attention
    kinds = ["gdn" if k == "gdn" else "attention" for k in target.kinds]
    period = len(twin.layout.pattern)
    assert len(kinds) % period == 0 and kinds == list(twin.layout.pattern) * (len(kinds) // period)
    target_widths = ("hidden_size", "intermediate_size", "linear_key_head_dim", "linear_value_head_dim",
                     "moe_intermediate_size", "shared_expert_intermediate_size")  # fmt: skip
    widths = [twin.config[k] for k in target_widths if k in twin.config]
    if not twin.layout.mrope_section:  # sections fix the head dim (256): only a free one is chosen
        widths.append(twin.config["head_dim"])
    if case.draft is not None:
        widths += [case.draft.config["intermediate_size"], case.draft.config["head_dim"]]
    counts = kept_counts(published()[twin.name]) | (kept_counts(published()[case.draft.name]) if case.draft else set())
    assert len(set(widths)) == len(widths) and not set(widths) & counts, (widths, counts)
    assert max(widths) <= 128 and sum(p.numel() for p in target.model.parameters()) < 20_000_000
    if case.draft is not None:
        assert case.draft.layout == DraftLayout.of(published()[case.draft.name])
        draft = draft_twin(case_id, "float32")
        assert draft is not None and draft.block_size == case.draft.layout.block_size
        assert all(0 <= i < target.num_layers for i in draft.target_layer_ids)
        assert len(set(draft.target_layer_ids)) == len(draft.target_layer_ids)
        sliding = [t == "sliding" for t in case.draft.layout.layer_types]
        assert [layer.self_attn.is_causal for layer in draft.layers] == sliding  # the published rule
        windows = [layer.self_attn.sliding_window for layer in draft.layers]
        assert [w is not None for w in windows] == [s and case.draft.layout.windowed for s in sliding]


def chunked_logits(target: TargetModel, tokens: torch.Tensor, chunk: int, last: int) -> torch.Tensor:
    """Prefill all but `last` tokens in chunks of `chunk`, then verify the rest as one chain."""
    cache = target.new_cache()
    target.prefill(cache, tokens[:-last], chunk=chunk)
    return target.verify(cache, Tree.chain(tokens[-last:])).logits.double()


@pytest.mark.compat
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TARGETS)
def test_logits_through_the_cache_equal_the_models_own_forward(name: str, dtype: str) -> None:
    """In every prefill chunk size: one token at a time, odd chunks that split the pattern, the whole prompt."""
    target = target_twin(name, dtype)
    tokens = prompt(0, 41)
    with torch.no_grad():
        reference = target.model(tokens[None]).logits[0].double()[-9:]
    scale = reference.abs().max().item()
    results = {chunk: chunked_logits(target, tokens, chunk, last=9) for chunk in (1, 3, 7, 32)}
    for chunk, logits in results.items():
        error = (logits - reference).abs().max().item()
        assert error <= own_forward_bound(target, scale, tokens.shape[0]), (chunk, error)
        assert (logits - results[32]).abs().max().item() <= model_bound(target, scale, 32), chunk


@pytest.mark.compat
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TARGETS)
def test_tree_verify_and_commit_equal_recomputation(name: str, dtype: str) -> None:
    target = target_twin(name, dtype)
    for seed in range(2):
        report = check_hybrid_cache(target, prompt(seed, 9 + 5 * seed), tree_size=24, seed=seed)
        bound = model_bound(target, scale=1.0, tree_size=24)
        assert report["tree_verify_max_abs_diff"] <= bound, report
        assert report["commit_logits_max_abs_diff"] <= bound, report


def model_recurrent_state(cache: object, layer: int) -> torch.Tensor:
    """The recurrent state [Hv, d_k, d_v] the model's own forward left in its cache (5.6.x: a layer's
    `recurrent_states`; newer releases: `get_recurrent_state`)."""
    if hasattr(cache, "get_recurrent_state"):
        state = cache.get_recurrent_state(layer)
    else:
        state = cache.layers[layer].recurrent_states
    return state[0]


@pytest.mark.compat
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [n for n, t in TARGETS.items() if t.layout.gdn_heads])
def test_committed_gdn_state_equals_the_models_recurrence(name: str, dtype: str) -> None:
    """After a tree is verified and one of its branches committed, each GDN layer's state is the one the
    model's own forward reaches over the prefix and that branch."""
    target = target_twin(name, dtype)
    generator = torch.Generator().manual_seed(3)
    prefix, tree = prompt(3, 13), random_tree(20, VOCAB - 1, generator)
    cache = target.new_cache()
    target.prefill(cache, prefix, chunk=5)
    target.verify(cache, tree)
    path = tree.path_to(tree.size - 1)
    cache.commit(path)
    tokens = torch.cat([prefix, tree.tokens[path]])
    with torch.no_grad():
        own = target.model(tokens[None], use_cache=True).past_key_values
    gdn_layers = [i for i, kind in enumerate(target.kinds) if kind == "gdn"]
    for slot, layer in enumerate(gdn_layers):
        expected = model_recurrent_state(own, layer).double()
        _, state = cache.gdn_state(slot)  # [Hk, r, d_k, d_v]
        actual = state.flatten(0, 1).double()
        assert actual.shape == expected.shape
        bound = own_forward_bound(target, expected.abs().max().item(), tokens.shape[0])
        assert (actual - expected).abs().max().item() <= bound, layer


NEW_TOKENS = 20
BUDGETS = (1, 8, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_id", CASES)
def test_speculative_decoding_is_lossless(case_id: str, dtype: str) -> None:
    """DFlash and DDTree emit AR's tokens, with the draft's twin and with the teacher; a windowed draft is
    given prompts longer than its window, so the window cuts the context."""
    case: TwinCase = CASES[case_id]
    twin: TwinTarget = case.target
    target, draft = target_twin(twin.name, dtype), draft_twin(case_id, dtype)
    window = case.draft.window if case.draft is not None else None
    block = draft.block_size if draft is not None else 16
    accepted_deep = sum(
        assert_lossless(
            target, prompt(seed, (window or 8) + 3 + 5 * seed), draft, BUDGETS, NEW_TOKENS, seed, VOCAB, block, 8
        )
        for seed in range(3)
    )
    assert accepted_deep >= 3, "the teacher made multi-token paths commit through every layer kind"
