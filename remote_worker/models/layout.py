"""The layout of a model: the counts and ratios that the worker's tensor shapes depend on.

Widths (hidden, intermediate, head dims), the vocabulary, the number of experts and the depth only size
the tensors; these decide how they are cut, grouped and indexed:

- the layer pattern (one period of Gated DeltaNet and full-attention layers),
- Gated DeltaNet key heads and value heads (value head h reads key head h // r) and the conv kernel,
- attention query heads and KV heads, a gated output, partial rotary and mrope sections,
- routed experts per token and a shared expert, tied or untied embeddings;
- for a DFlash draft: its layer types, whether it has a sliding window, its block size, how many target
  layers it reads, its query and KV heads, and where its config keeps `block_size`.

A layout is read from a `config.json` (as published, or as a loaded model's config gives it back), so
the published checkpoints' layouts (`remote_worker/data/model_configs/`), the tiny twins built from them
(`remote_worker.models.twins`) and a model a run loads are compared by the same code. A run whose layout
no twin has is told so (`uncovered_warning`): `make test` has never exercised it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent.parent
PUBLISHED_DIR = PACKAGE_DIR / "data" / "model_configs"
FIXTURES_DIR = PACKAGE_DIR / "fixtures"

_KINDS = {"linear_attention": "gdn", "full_attention": "attention", "sliding_attention": "sliding"}


def text_config(values: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (a multimodal checkpoint nests it under `text_config`)."""
    return dict(values.get("text_config") or values)


def layer_types(text: dict[str, Any]) -> list[str]:
    """Every layer's type: `layer_types` when given, else Qwen3-Next's `full_attention_interval`, else all
    full attention (dense Qwen3)."""
    count = int(text["num_hidden_layers"])
    if text.get("layer_types"):
        return list(text["layer_types"])[:count]
    interval = text.get("full_attention_interval") or (4 if "linear_num_key_heads" in text else None)
    if interval:  # Qwen3-Next's rule (transformers' default interval: 4)
        return ["full_attention" if (i + 1) % int(interval) == 0 else "linear_attention" for i in range(count)]
    return ["full_attention"] * count


def period(types: list[str]) -> int:
    """The shortest p such that the pattern repeats every p layers (the whole depth when it never does)."""
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return len(types)


def rope_values(text: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters` (transformers ≥ 5) or the older `rope_scaling`, merged over the top level."""
    merged = {k: text[k] for k in ("partial_rotary_factor", "rope_theta") if k in text}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(text.get(key), dict):
            merged.update(text[key])
    return merged


@dataclass(frozen=True)
class TargetLayout:
    pattern: tuple[str, ...]  # one period: "gdn" / "attention"
    gdn_heads: tuple[int, int] | None  # (key heads, value heads); None without GDN layers
    conv_kernel: int | None
    attention_heads: tuple[int, int]  # (query heads, KV heads)
    gated_attention: bool
    partial_rotary: float
    mrope_section: tuple[int, ...] | None
    experts: tuple[int, bool] | None  # (routed experts per token, shared expert); None for a dense MLP
    tied_embeddings: bool

    @staticmethod
    def of(values: dict[str, Any]) -> TargetLayout:
        text = text_config(values)
        types = layer_types(text)
        pattern = tuple(_KINDS.get(t, t) for t in types[: period(types)])
        rope = rope_values(text)
        has_gdn = "gdn" in pattern
        model_type = str(text.get("model_type", ""))
        experts = int(text.get("num_experts") or 0)
        section = rope.get("mrope_section")
        return TargetLayout(
            pattern=pattern,
            gdn_heads=(int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])) if has_gdn else None,
            conv_kernel=int(text["linear_conv_kernel_dim"]) if has_gdn else None,
            attention_heads=(
                int(text["num_attention_heads"]),
                int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            ),
            # Qwen3.5/3.6 and Qwen3-Next gate the attention output (transformers' default for them)
            gated_attention=bool(text.get("attn_output_gate", model_type.startswith(("qwen3_5", "qwen3_next")))),
            partial_rotary=float(rope.get("partial_rotary_factor", 1.0)),
            mrope_section=tuple(int(s) for s in section) if section else None,
            experts=(int(text["num_experts_per_tok"]), bool(text.get("shared_expert_intermediate_size"))) if experts
            else None,
            tied_embeddings=bool(values.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )  # fmt: skip

    def params(self) -> dict[str, str]:
        """As MLflow params (`layout.*`)."""
        gdn = "none" if self.gdn_heads is None else "{}/{} (r={})".format(*self.gdn_heads, self._ratio(self.gdn_heads))
        q, kv = self.attention_heads
        return {
            "layout.pattern": "+".join(self.pattern),
            "layout.gdn_key_value_heads": gdn,
            "layout.conv_kernel": str(self.conv_kernel or "none"),
            "layout.attention_query_kv_heads": f"{q}/{kv}",
            "layout.gated_attention": str(self.gated_attention),
            "layout.partial_rotary": f"{self.partial_rotary:g}",
            "layout.mrope_section": ",".join(map(str, self.mrope_section)) if self.mrope_section else "none",
            "layout.experts": "dense" if self.experts is None else f"{self.experts[0]} routed"
            + (" + shared" if self.experts[1] else ""),
            "layout.tied_embeddings": str(self.tied_embeddings),
        }  # fmt: skip

    @staticmethod
    def _ratio(heads: tuple[int, int]) -> str:
        key, value = heads
        return str(value // key) if value % key == 0 else f"{value}/{key}"

    def describe(self) -> str:
        """One line: 'gdn+gdn+gdn+attention, GDN 16/48, attention 24/4 gated, rotary 0.25 mrope 11,11,10'."""
        parts = ["+".join(self.pattern)]
        if self.gdn_heads:
            parts.append("GDN {}/{}".format(*self.gdn_heads))
        parts.append("attention {}/{}{}".format(*self.attention_heads, " gated" if self.gated_attention else ""))
        if self.partial_rotary != 1.0 or self.mrope_section:
            mrope = f" mrope {','.join(map(str, self.mrope_section))}" if self.mrope_section else ""
            parts.append(f"rotary {self.partial_rotary:g}{mrope}")
        if self.experts:
            parts.append(f"{self.experts[0]} experts/token{' + shared' if self.experts[1] else ''}")
        return ", ".join(parts)


@dataclass(frozen=True)
class DraftLayout:
    layer_types: tuple[str, ...]  # "attention" / "sliding", per layer
    # sliding layers with a window that applies (its size is a length, not a shape): transformers' Qwen3Config,
    # which the published drafts and this worker load them with, drops `sliding_window` unless
    # `use_sliding_window` is set; the nested schema's sliding layers are then causal with no window
    windowed: bool
    block_size: int
    target_layers: int
    attention_heads: tuple[int, int]
    nested_block_size: bool  # `block_size` inside `dflash_config` (the newer schema)

    @staticmethod
    def of(values: dict[str, Any]) -> DraftLayout:
        dflash = dict(values.get("dflash_config") or {})
        count = int(values["num_hidden_layers"])
        types = list(values.get("layer_types") or ["full_attention"] * count)[:count]
        kinds = tuple(_KINDS.get(t, t) for t in types)
        return DraftLayout(
            layer_types=kinds,
            windowed="sliding" in kinds
            and bool(values.get("sliding_window"))
            and bool(values.get("use_sliding_window")),
            block_size=int(dflash.get("block_size") or values.get("block_size") or 0),
            target_layers=len(dflash.get("target_layer_ids") or ()),
            attention_heads=(
                int(values["num_attention_heads"]),
                int(values.get("num_key_value_heads") or values["num_attention_heads"]),
            ),
            nested_block_size="block_size" in dflash,
        )

    def params(self, window: int | None, target_layer_ids: tuple[int, ...]) -> dict[str, str]:
        return {
            "layout.draft_layer_types": ",".join(self.layer_types),
            "layout.draft_window": str(window) if self.windowed and window else "none",
            "layout.draft_target_layers": ",".join(map(str, target_layer_ids)),
            "layout.draft_block_size": str(self.block_size),
            "layout.draft_query_kv_heads": "{}/{}".format(*self.attention_heads),
        }


def is_draft(values: dict[str, Any]) -> bool:
    return "dflash_config" in values


@cache
def published() -> dict[str, dict[str, Any]]:
    """The published configs shipped with the worker, by checkpoint name ('Qwen3.6-27B', …)."""
    return {
        path.name.removesuffix(".json").removesuffix(".config"): json.loads(path.read_text(encoding="utf-8"))
        for path in sorted(PUBLISHED_DIR.glob("*.json"))
    }


@cache
def tested() -> dict[str, dict[str, Any]]:
    """Every config whose layout `make test` decodes: the published ones (through their twins) and the
    trained fixtures shipped with the worker (as they are)."""
    fixtures = {
        f"fixture {path.parent.parent.name}/{path.parent.name}": json.loads(path.read_text(encoding="utf-8"))
        for path in sorted(FIXTURES_DIR.glob("*/*/config.json"))
    }
    return {**published(), **fixtures}


@cache
def _tested_layouts() -> tuple[list[tuple[str, TargetLayout]], list[tuple[str, DraftLayout]]]:
    """The layouts of `tested()`, read once."""
    configs = tested().items()
    return (
        [(name, TargetLayout.of(v)) for name, v in configs if not is_draft(v)],
        [(name, DraftLayout.of(v)) for name, v in configs if is_draft(v)],
    )


def covering_target(layout: TargetLayout) -> list[str]:
    """The tested models (published ones, through their twins, and fixtures) with this layout."""
    return [name for name, tested_layout in _tested_layouts()[0] if tested_layout == layout]


def covering_draft(layout: DraftLayout) -> list[str]:
    return [name for name, tested_layout in _tested_layouts()[1] if tested_layout == layout]


def uncovered_warning(target: TargetLayout, draft: DraftLayout | None) -> str | None:
    """One line when no twin in `make test` has this layout (its exactness was never checked at these shapes)."""
    missing = []
    if not covering_target(target):
        missing.append(f"target ({target.describe()})")
    if draft is not None and not covering_draft(draft):
        missing.append(f"draft ({','.join(draft.layer_types)}, block {draft.block_size}, heads "
                       f"{draft.attention_heads[0]}/{draft.attention_heads[1]})")  # fmt: skip
    if not missing:
        return None
    return (
        f"layout never checked by make test: {'; '.join(missing)}; add the checkpoint's config.json to "
        "remote_worker/data/model_configs/ and make test checks a twin of it"
    )


def layout_params(
    model: Any, draft: dict[str, Any] | None, checkpoint: bool = True
) -> tuple[dict[str, str], str | None]:
    """What a run records of the layout it loaded (`layout.*` params: heads, pattern, rotary, the draft's layer
    types, window and target layers, and which tested model has the same layout), and the one-line warning
    when none does. `model`: a loaded transformers model; `draft`: the draft's config values; `checkpoint`:
    the model was loaded from a checkpoint (a model built from an inline config is a test model of the
    user's own, tested where it is defined: no warning)."""
    config = model.config
    target = TargetLayout.of({**config.to_dict(), "text_config": config.get_text_config().to_dict()})
    params = target.params()
    params["layout.tested_as"] = ", ".join(covering_target(target)) or "none"
    draft_layout = None if draft is None else DraftLayout.of(draft)
    if draft is not None and draft_layout is not None:
        window = draft.get("sliding_window") if draft_layout.windowed else None
        ids = tuple((draft.get("dflash_config") or {}).get("target_layer_ids") or ())
        params.update(draft_layout.params(window, ids))
        params["layout.draft_tested_as"] = ", ".join(covering_draft(draft_layout)) or "none"
    return params, uncovered_warning(target, draft_layout) if checkpoint else None
