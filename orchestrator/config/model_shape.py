"""What the orchestrator can know of a model's shape before launch, from its config: the vocabulary, the
context and the draft's block size (for the checks of prompts and tree budgets in `validation.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.config.checkpoints import local_checkpoint


@dataclass(frozen=True)
class ModelShape:
    """What the orchestrator can know of the model before launch; None where its config is out of reach."""

    name: str
    vocab: int | None
    context: int | None
    block_size: int | None


def _config_values(section: dict[str, Any], local: bool) -> dict[str, Any]:
    """A model's (or draft's) config: inline, or the config.json of a checkpoint this machine can read (a
    relative path names a fixture inside the worker's package; an absolute one is read when the host is
    this machine). Empty when out of reach or unreadable: the worker reports a broken checkpoint."""
    if section.get("source") == "config":
        return dict(section.get("config") or {})
    path = local_checkpoint(section, local)
    if path is None:
        return {}
    try:
        values = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def positive_int(value: Any) -> bool:
    """An int of at least 1, never a bool (a config's `true` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive(value: Any) -> int | None:
    return value if positive_int(value) else None


def model_shape(container: dict[str, Any]) -> ModelShape:
    """The vocabulary, the context and the draft's block size, where the config says them."""
    model, local = container["model"], container["host"]["kind"] == "local"
    target = _config_values(model, local)
    text = target.get("text_config") if isinstance(target.get("text_config"), dict) else target
    draft = _config_values(model["draft"], local) if isinstance(model.get("draft"), dict) else {}
    dflash = draft.get("dflash_config") if isinstance(draft.get("dflash_config"), dict) else {}
    block = container["decode"].get("block_size") or dflash.get("block_size") or draft.get("block_size")
    return ModelShape(
        str(model.get("name")), _positive(text.get("vocab_size")), _positive(text.get("max_position_embeddings")),
        _positive(block),
    )  # fmt: skip
