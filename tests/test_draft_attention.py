"""The drafter's attention follows the published drafts' per-layer rule, checked against a direct implementation.

The rule: a layer is causal when the config's top-level `is_causal` says so, else when it is a
`sliding_attention` layer; a sliding layer with a window w sees only keys with |query - key| < w. The direct
implementation below decides every (query, key) pair from those two sentences, over the whole context,
one query at a time; the drafter reads only the keys a window can reach. They must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from remote_worker.cache.hybrid_cache import apply_rope
from remote_worker.models.dflash import DFlashDraft, build_draft, draft_config, layer_rules, load_draft
from tests.tiny_models import random_prompt, tiny

# worker: only the worker's dependencies; compat: it touches transformers, so `make test-compat` runs it
# under the oldest supported release too
pytestmark = [pytest.mark.worker, pytest.mark.compat]

FIXTURES = Path(__file__).resolve().parent.parent / "remote_worker" / "fixtures"


def config(layer_types: list[str], **extra: object) -> dict:
    return dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        block_size=8,
        layer_types=layer_types,
        dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 511},
        **extra,
    )


def direct_logits(
    draft: DFlashDraft, features: torch.Tensor, root: torch.Tensor, mask: torch.Tensor, head
) -> torch.Tensor:
    """Draft logits computed pair by pair from the rule, over the whole context (no window shortcut)."""
    context, block = features.shape[0], draft.block_size
    projected = draft.hidden_norm(draft.fc(features))
    cos_c, sin_c = draft._rope(projected, 0, context)
    h = torch.cat([root[None], mask[None].expand(block - 1, -1)])
    cos_b, sin_b = draft._rope(h, context, block)
    forced = getattr(draft.config, "is_causal", None)
    types = draft.config.layer_types or ["full_attention"] * len(draft.layers)
    for layer, layer_type in zip(draft.layers, types, strict=True):
        attn = layer.self_attn
        sliding = layer_type == "sliding_attention"
        causal = bool(forced) if forced is not None else sliding
        window = draft.config.sliding_window if sliding else None
        x = layer.input_layernorm(h)
        q = apply_rope(attn.q_norm(attn.q_proj(x).view(block, attn.num_heads, -1)).transpose(0, 1), cos_b, sin_b)
        kc, vc = attn.keys_values(projected, cos_c, sin_c)
        kb, vb = attn.keys_values(x, cos_b, sin_b)
        keys, values = torch.cat([kc, kb], 1), torch.cat([vc, vb], 1)
        groups = attn.num_heads // attn.num_kv_heads
        out = torch.zeros(block, attn.num_heads, attn.head_dim, dtype=h.dtype)
        for i in range(block):
            p = context + i
            seen = [
                k for k in range(context + block) if (not causal or k <= p) and (window is None or abs(p - k) < window)
            ]
            for head_index in range(attn.num_heads):
                kv = head_index // groups
                scores = torch.stack([q[head_index, i] @ keys[kv, k] for k in seen]) * attn.scaling
                weights = torch.softmax(scores, dim=0)
                out[i, head_index] = sum(w * values[kv, k] for w, k in zip(weights, seen, strict=True))
        h = h + attn.o_proj(out.reshape(block, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return head(draft.norm(h[1:]))


CASES = {
    # The Qwen3.6 draft pattern: sliding layers causal and windowed, a full layer non-causal and unwindowed.
    "sliding-then-full": config(
        ["sliding_attention", "sliding_attention", "full_attention"], sliding_window=6, use_sliding_window=True
    ),
    # A window narrower than the block hides block keys on both sides of a non-causal query.
    "is_causal-false-narrow-window": config(
        ["sliding_attention", "full_attention"], sliding_window=3, use_sliding_window=True, is_causal=False
    ),
    # is_causal at the top level makes every layer causal, full-attention ones included.
    "is_causal-true": config(
        ["full_attention", "sliding_attention"], sliding_window=5, use_sliding_window=True, is_causal=True
    ),
    # Without layer_types every layer is full attention: non-causal, unwindowed (the trained fixtures).
    "all-full": config(["full_attention", "full_attention"]),
    # Qwen3Config drops sliding_window unless use_sliding_window is set: causal, but no window.
    "sliding-without-window": config(["sliding_attention", "full_attention"], sliding_window=4),
}


@pytest.mark.parametrize("context", [1, 4, 13])
@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_attention_matches_the_rule_pair_by_pair(case: str, context: int) -> None:
    target, _ = tiny("tiny_hybrid", "float64")
    draft = build_draft(CASES[case], seed=11, dtype=torch.float64, device=torch.device("cpu"))
    tokens = random_prompt(7).repeat(3)[: context + 1]
    features = target.prefill(target.new_cache(), tokens[:-1], draft.feature_layers)
    root, mask = target.embed(tokens[-1]), target.embed(torch.tensor(draft.mask_token_id))
    state = draft.new_context(capacity=2)  # grows while extended in two pieces
    draft.extend(state, features[: context // 2])
    draft.extend(state, features[context // 2 :])
    with torch.no_grad():
        fast = draft.propose(state, root, mask, target.head)
        direct = direct_logits(draft, features, root, mask, target.head)
    torch.testing.assert_close(fast, direct, rtol=1e-10, atol=1e-10)


def test_layer_rules_read_the_config() -> None:
    rules = layer_rules(draft_config(CASES["sliding-then-full"]))
    assert rules == [(True, 6), (True, 6), (False, None)]
    assert layer_rules(draft_config(CASES["is_causal-true"])) == [(True, None), (True, 5)]
    assert layer_rules(draft_config(CASES["is_causal-false-narrow-window"])) == [(False, 3), (False, None)]


def test_the_rule_changes_what_a_draft_proposes() -> None:
    """The same weights drafted non-causally (as every layer was before) give other logits: the rule matters."""
    target, _ = tiny("tiny_hybrid", "float64")
    causal = build_draft(CASES["sliding-then-full"], seed=3, dtype=torch.float64, device=torch.device("cpu"))
    loose = DFlashDraft(draft_config({**CASES["sliding-then-full"], "is_causal": False, "sliding_window": None}))
    loose.load_state_dict(causal.state_dict())
    loose = loose.double()
    tokens = random_prompt(2)
    features = target.prefill(target.new_cache(), tokens[:-1], causal.feature_layers)
    root, mask = target.embed(tokens[-1]), target.embed(torch.tensor(causal.mask_token_id))
    outputs = []
    for draft in (causal, loose):
        state = draft.new_context()
        draft.extend(state, features)
        outputs.append(draft.propose(state, root, mask, target.head))
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-6)


def test_block_size_may_sit_in_dflash_config(tmp_path: Path) -> None:
    values = config(["full_attention"])
    values.pop("block_size")
    values["dflash_config"] = {**values["dflash_config"], "block_size": 16}
    draft = build_draft(values, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    assert draft.block_size == 16
    values["dflash_config"].pop("block_size")
    with pytest.raises(ValueError, match="block_size"):
        build_draft(values, seed=0, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("pair", ["tiny_trained", "tiny_trained_dense"])
def test_fixture_draft_configs_load_where_the_reference_class_needs_more(pair: str) -> None:
    """The reference draft class is built from AutoConfig (needs model_type) and reads num_target_layers to
    place its target layers when dflash_config has none; our fixture configs carry both."""
    draft_dir, target_dir = FIXTURES / pair / "draft", FIXTURES / pair / "target"
    loaded = AutoConfig.from_pretrained(draft_dir)
    assert loaded.model_type == "qwen3"
    target_layers = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]
    assert loaded.num_target_layers == target_layers
    assert all(0 <= i < loaded.num_target_layers for i in loaded.dflash_config["target_layer_ids"])
    assert loaded.block_size >= 2 and loaded.dflash_config["mask_token_id"] < loaded.vocab_size
    draft = load_draft(draft_dir, torch.float32, torch.device("cpu"))  # and still in ours
    assert draft.block_size == loaded.block_size


def test_rotary_frequencies_stay_float32_in_bfloat16() -> None:
    draft = build_draft(config(["full_attention"]), seed=0, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert draft.fc.weight.dtype == torch.bfloat16
    assert draft.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize(
    "extra",
    [{"input_embedding_scale": 2.5}, {"final_logit_softcapping": 30.0}, {"conv_kernel_size": 2}],
)
def test_entries_of_other_drafter_variants_are_refused_not_ignored(extra: dict) -> None:
    values = config(["full_attention"])
    values["dflash_config"] = {**values["dflash_config"], **extra}
    with pytest.raises(ValueError, match=f"^draft config sets dflash_config {next(iter(extra))}="):
        build_draft(values, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    neutral = config(["full_attention"])
    neutral["dflash_config"] = {**neutral["dflash_config"], "input_embedding_scale": 1.0, "block_size": 4}
    assert build_draft(neutral, seed=0, dtype=torch.float32, device=torch.device("cpu")).block_size == 4
