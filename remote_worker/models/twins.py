"""Tiny twins of the published models, derived by code from their `config.json`.

A twin shrinks only what no shape in the worker depends on and keeps every count and ratio that some
shape does depend on (`remote_worker.models.layout`), so a test on the twin exercises the same
reshapes, groupings and index arithmetic as the real checkpoint, at a size a CPU decodes in seconds.

Shrunk: the widths (hidden, intermediate, GDN key and value head dims, the attention head dim unless mrope
sections pin it, the experts' widths), the vocabulary (512), the number of experts (twice the routed
experts per token), the depth (whole periods of the layer pattern: two, or enough for the drafts' target
layers to stay distinct; a `full_depth` twin keeps the published depth, for what grows with it), and a
draft's sliding window (w → max(block_size + 1, w / 64), so contexts of a few dozen tokens already pass
it, as real contexts pass 2048).

Kept: the layer pattern, GDN key/value heads (16:48, 16:32), the conv kernel, attention query/KV heads
(24:4, 16:2, 32:8), the gated attention output, partial rotary and mrope sections (the head dim that
sections of 11+11+10 frequencies at 0.25 imply, 256, is kept), routed experts per token and the shared
expert, tied or untied embeddings; for a draft its layer types, block size, number of target layers
(mapped proportionally into the cut depth), query/KV heads and the schema it keeps `block_size` in.

Every width is chosen to differ from every kept count and from every other width, so that no two axes of
a tensor are equal by accident: a bug that reads one axis for another fails on a twin as on the real model
(the 2-key-head, 4-value-head toys hid one such bug). A config added to `data/model_configs/` gets its twin,
and its place in the exactness suite, with no new code.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from remote_worker.models.layout import (
    DraftLayout,
    TargetLayout,
    is_draft,
    layer_types,
    period,
    published,
    rope_values,
    text_config,
)

VOCAB = 512
WINDOW_SCALE = 64
# Keys that describe a file or a tokenizer, not a shape (token ids would fall outside the twin's vocabulary).
_DROP = {
    "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id",
}  # fmt: skip
# Each width: the first value of its progression (start, step) that equals no kept count and no width
# chosen before it, so the supply never runs out however many drafts share a target.
_WIDTHS = {
    "hidden": (40, 4),
    "intermediate": (72, 4),
    "gdn_key_dim": (8, 2),
    "gdn_value_dim": (12, 2),
    "head_dim": (40, 8),  # multiples of 8: a 0.25 partial rotary stays an even number of dims
    "expert_intermediate": (20, 4),
    "shared_intermediate": (36, 4),
    "draft_intermediate": (80, 4),
    "draft_head_dim": (20, 4),
}


def _pick(kind: str, taken: set[int], accept: Any = None) -> int:
    """The first width of `kind`'s progression that equals no kept count and no width already chosen."""
    start, step = _WIDTHS[kind]
    width = next(w for w in itertools.count(start, step) if w not in taken and (accept is None or accept(w)))
    taken.add(width)
    return width


def text_arch(architectures: list[str]) -> str:
    """The class a run loads: a multimodal checkpoint is used text-only (as conf/model/ does)."""
    arch = architectures[0]
    return arch.replace("ForConditionalGeneration", "ForCausalLM")


@dataclass(frozen=True)
class TwinTarget:
    name: str  # the published checkpoint's name
    arch: str  # the transformers class the twin is built with
    config: dict[str, Any]  # keyword arguments of that class's config
    model_type: str

    @property
    def layout(self) -> TargetLayout:
        return TargetLayout.of({**self.config, "model_type": self.model_type})


@dataclass(frozen=True)
class TwinDraft:
    name: str
    config: dict[str, Any]  # a DFlash config.json's values, in the published schema

    @property
    def layout(self) -> DraftLayout:
        return DraftLayout.of(self.config)

    @property
    def window(self) -> int | None:
        return self.config.get("sliding_window") if self.layout.windowed else None


@dataclass(frozen=True)
class TwinCase:
    """A target twin and one draft twin to decode with (None: the target has no published draft)."""

    target: TwinTarget
    draft: TwinDraft | None

    @property
    def id(self) -> str:
        return self.target.name if self.draft is None else self.draft.name


def kept_counts(values: dict[str, Any]) -> set[int]:
    """Every count a config's shapes depend on, read off its layout (kept by its twin; no width may equal
    one), with the published depth and the twin's number of experts."""
    counts = {int(text_config(values)["num_hidden_layers"])}
    if is_draft(values):
        draft = DraftLayout.of(values)
        heads = draft.attention_heads
        counts.update((draft.block_size, draft.target_layers))
    else:
        target = TargetLayout.of(values)
        heads = target.attention_heads
        if target.gdn_heads:
            key, value = target.gdn_heads
            counts.update((key, value, value // key, target.conv_kernel or 0))
        if target.experts:
            counts.update((target.experts[0], 2 * target.experts[0]))  # routed per token; the twin's experts
    counts.update((*heads, heads[0] // heads[1]))
    return counts - {0}


def _depth(text: dict[str, Any], draft_layers: int) -> int:
    """Whole periods of the pattern: two, or more when a draft reads more target layers than that (never
    more than the model has: a pattern that does not repeat is its whole depth)."""
    types = layer_types(text)
    p = period(types)
    return min(len(types), p * max(2, math.ceil(draft_layers / p)))


def map_layers(ids: Iterable[int], published_depth: int, depth: int) -> list[int]:
    """Target layer ids of a `published_depth`-layer model placed proportionally in `depth` layers, kept
    distinct and increasing where the depth allows."""
    mapped: list[int] = []
    for i in ids:
        layer = min(depth - 1, int(i) * depth // published_depth)
        if mapped and layer <= mapped[-1] and mapped[-1] + 1 < depth:
            layer = mapped[-1] + 1
        mapped.append(layer)
    return mapped


def _cut(values: dict[str, Any], depth: int, vocab: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The published text config and a copy of it for the twin: file and tokenizer keys dropped, `depth`
    layers, `vocab` tokens."""
    text = text_config(values)
    config = {k: v for k, v in text.items() if k not in _DROP}
    config.update(vocab_size=vocab, num_hidden_layers=depth)
    if "layer_types" in text:
        config["layer_types"] = list(text["layer_types"])[:depth]
    return text, config


def target_twin(
    name: str, values: dict[str, Any], drafts: list[dict[str, Any]], taken: set[int], full_depth: bool = False
) -> TwinTarget:
    """The target's twin: whole periods of its pattern (`_depth`), or with `full_depth` every published layer
    (what the compile time and the cache's per-layer work are measured and tested at)."""
    draft_layers = max((len(d["dflash_config"]["target_layer_ids"]) for d in drafts), default=0)
    text = text_config(values)
    depth = len(layer_types(text)) if full_depth else _depth(text, draft_layers)
    text, config = _cut(values, depth, VOCAB)
    rope = rope_values(text)
    section = rope.get("mrope_section")
    partial = float(rope.get("partial_rotary_factor", 1.0))
    if section:  # mrope sections count rotary frequencies: they fix the rotary dims, and so the head dim
        head_dim = round(2 * sum(section) / partial)
        taken.add(head_dim)
    else:
        head_dim = _pick("head_dim", taken, lambda w: (w * partial) % 2 == 0)
    config.update(hidden_size=_pick("hidden", taken), intermediate_size=_pick("intermediate", taken), head_dim=head_dim)
    if text.get("linear_num_key_heads"):
        config.update(
            linear_key_head_dim=_pick("gdn_key_dim", taken), linear_value_head_dim=_pick("gdn_value_dim", taken)
        )
    if text.get("num_experts"):
        config.update(
            num_experts=2 * int(text["num_experts_per_tok"]), moe_intermediate_size=_pick("expert_intermediate", taken)
        )
        if text.get("shared_expert_intermediate_size"):
            config["shared_expert_intermediate_size"] = _pick("shared_intermediate", taken)
    if "tie_word_embeddings" in values:  # a multimodal config says it at the top level
        config["tie_word_embeddings"] = values["tie_word_embeddings"]
    return TwinTarget(name, text_arch(values["architectures"]), config, str(text.get("model_type", "")))


def draft_twin(name: str, values: dict[str, Any], target: TwinTarget, taken: set[int]) -> TwinDraft:
    config = {k: v for k, v in values.items() if k not in _DROP}
    depth = target.config["num_hidden_layers"]
    dflash = dict(config["dflash_config"])
    published_depth = int(values.get("num_target_layers") or max(dflash["target_layer_ids"]) + 1)
    dflash.update(
        target_layer_ids=map_layers(dflash["target_layer_ids"], published_depth, depth), mask_token_id=VOCAB - 1
    )
    config.update(
        vocab_size=VOCAB,
        hidden_size=target.config["hidden_size"],
        intermediate_size=_pick("draft_intermediate", taken),
        head_dim=_pick("draft_head_dim", taken),
        num_target_layers=depth,
        dflash_config=dflash,
    )
    if config.get("sliding_window"):
        block = int(dflash.get("block_size") or config["block_size"])
        config["sliding_window"] = max(block + 1, int(config["sliding_window"]) // WINDOW_SCALE)
    return TwinDraft(name, config)


def draft_target(draft: str, targets: list[str]) -> str:
    """The published target a draft is for: the one its name extends ('Qwen3.6-27B-DFlash' → 'Qwen3.6-27B'),
    else, for a draft whose target is not in the set, the target of its vocabulary whose name shares the
    longest prefix with it (the draft's shapes are what is tested; its target layers are mapped anyway)."""
    own = [t for t in targets if draft.startswith(t + "-")]
    if own:
        return max(own, key=len)
    vocab = published()[draft].get("vocab_size")
    family = [t for t in targets if text_config(published()[t]).get("vocab_size") == vocab] or targets
    # character by character on purpose: names, not paths
    return max(family, key=lambda t: (len(os.path.commonprefix([t, draft])), t))  # noqa: RUF071


def twin_cases(full_depth: bool = False) -> list[TwinCase]:
    """Every published draft with its target's twin, and every target without a draft on its own; with
    `full_depth`, the twins have the published depth (64 layers for the 27B models, 48 for Qwen3-Next) and
    the drafts read the published target layers, the widths staying tiny."""
    configs = published()
    targets = [name for name, values in configs.items() if not is_draft(values)]
    drafts = [name for name, values in configs.items() if is_draft(values)]
    paired = {t: [d for d in drafts if draft_target(d, targets) == t] for t in targets}
    cases = []
    for target in targets:
        family = [configs[target], *(configs[d] for d in paired[target])]
        taken = set().union(*(kept_counts(v) for v in family))
        twin = target_twin(target, configs[target], [configs[d] for d in paired[target]], taken, full_depth)
        cases.extend(TwinCase(twin, draft_twin(d, configs[d], twin, taken)) for d in paired[target])
        if not paired[target]:
            cases.append(TwinCase(twin, None))
    return cases


def one_period(name: str, vocab: int = 1024) -> TwinTarget:
    """The published target at its real widths, cut to one whole period of its layer pattern, with a small
    vocabulary (the embedding and head are the only tensors it sizes): the real-width check's model."""
    values = published()[name]
    text, config = _cut(values, period(layer_types(text_config(values))), vocab)
    return TwinTarget(name, text_arch(values["architectures"]), config, str(text.get("model_type", "")))
