"""How transformers' own cache behaves on this model, and whether the paper's crop-based rollback works.

The DDTree/DFlash reference code rolls a rejected draft back with `DynamicCache.crop`. On a dense model
that is exact; on a hybrid model the Gated DeltaNet layers keep a recurrent state that a crop cannot put
back. This probe measures it: crop, continue with the next token, and compare the logits with a fresh
prefill of the same prefix.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

METHODS_OF_INTEREST = (
    "activate_past_recording",
    "batch_select_indices",
    "crop",
    "get_mask_sizes",
    "get_seq_length",
    "reorder_cache",
    "reset",
    "update",
    "update_conv_state",
    "update_recurrent_state",
)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def native_crop(cache: DynamicCache, remove: int) -> None:
    """Call the release's own crop: newer releases take a negative count, older ones the length to keep."""
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(-remove)
    else:
        cache.crop(cache.get_seq_length() - remove)


def layer_class_counts(cache: DynamicCache) -> dict[str, int]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        return {}
    return dict(sorted(Counter(type(layer).__name__ for layer in layers).items()))


def _next_logits(model: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache | None) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids, past_key_values=cache, use_cache=cache is not None)
    return out.logits[0, -1].double()


def crop_and_continue(
    model: PreTrainedModel, input_ids: torch.Tensor, remove: int, record_past: bool
) -> dict[str, Any]:
    """Prefill, crop `remove` tokens, continue with the next prefix token; compare with a fresh prefill."""
    keep = input_ids.shape[1] - remove
    cache = DynamicCache(config=model.config)
    if record_past:
        cache.activate_past_recording()
    _next_logits(model, input_ids, cache)
    try:
        native_crop(cache, remove)
    except Exception as exc:  # noqa: BLE001 - the exact failure is the answer
        return {"result": describe_error(exc)}
    length_after = cache.get_seq_length()
    continued = _next_logits(model, input_ids[:, keep : keep + 1], cache)
    fresh = _next_logits(model, input_ids[:, : keep + 1], None)
    return {
        "result": "ok",
        "seq_length_after_crop": length_after,
        "expected_seq_length": keep,
        "logits_max_abs_diff": float((continued - fresh).abs().max()),
    }


def probe_cache(model: PreTrainedModel, input_ids: torch.Tensor, remove: int) -> dict[str, Any]:
    if not 0 < remove < input_ids.shape[1]:
        raise ValueError(f"probe.crop_tokens={remove} must be between 1 and probe.prefill_tokens-1")
    report: dict[str, Any] = {}
    try:
        cache = DynamicCache(config=model.config)
        report["prebuilt_from_config"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the exact failure is the answer
        report["prebuilt_from_config"] = describe_error(exc)
        cache = DynamicCache()
    report["layer_classes_before_forward"] = layer_class_counts(cache)
    report["methods"] = [m for m in METHODS_OF_INTEREST if callable(getattr(cache, m, None))]
    report["methods_missing"] = [m for m in METHODS_OF_INTEREST if not callable(getattr(cache, m, None))]
    _next_logits(model, input_ids, cache)
    report["layer_classes_after_prefill"] = layer_class_counts(cache)
    report["seq_length_after_prefill"] = cache.get_seq_length()
    croppable = getattr(cache, "is_croppable", None)
    report["reports_croppable"] = "not reported" if croppable is None else bool(croppable)
    report["native_crop"] = crop_and_continue(model, input_ids, remove, record_past=False)
    if "activate_past_recording" in report["methods"]:
        report["recording_crop"] = crop_and_continue(model, input_ids, remove, record_past=True)
    return report
