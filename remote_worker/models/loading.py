"""Build a target model from a spec: a seeded tiny model from an inline config, or a checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from remote_worker.models.dflash import DFlashDraft, build_draft, load_draft
from remote_worker.spec import ModelSpec

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


PACKAGE_DIR = Path(__file__).resolve().parent.parent


def checkpoint_dir(path: str | None) -> Path:
    """A checkpoint directory; a relative path names a fixture inside this package (remote_worker/fixtures/...)."""
    folder = Path(path or "")
    return folder if folder.is_absolute() else PACKAGE_DIR / folder


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device='cuda' but torch sees no CUDA device on this host")
    return torch.device(name)


def model_class(arch: str) -> type[transformers.PreTrainedModel]:
    cls = getattr(transformers, arch, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise ValueError(
            f"model.arch={arch!r} is not a model class of transformers {transformers.__version__} on this host"
        )
    return cls


def load_model(spec: ModelSpec, seed: int) -> transformers.PreTrainedModel:
    """Return the model in eval mode, on its device, in its dtype."""
    cls = model_class(spec.arch)
    dtype = DTYPES[spec.dtype]
    device = resolve_device(spec.device)
    if spec.source == "config":
        config = cls.config_class(**spec.config)
        torch.manual_seed(seed)
        model = cls(config).to(dtype=dtype)
    else:
        path = checkpoint_dir(spec.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json (model.path)")
        model = cls.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def load_drafter(spec: ModelSpec, seed: int, target: transformers.PreTrainedModel) -> DFlashDraft:
    """The model's DFlash drafter, on the target's device and in its dtype."""
    if spec.draft is None:
        raise ValueError(f"model {spec.name} has no draft (model.draft)")
    parameter = next(target.parameters())
    if spec.draft.source == "config":
        draft = build_draft(spec.draft.config, seed, parameter.dtype, parameter.device)
    else:
        draft = load_draft(checkpoint_dir(spec.draft.path), parameter.dtype, parameter.device)
    hidden = target.get_input_embeddings().embedding_dim
    if draft.config.hidden_size != hidden:
        raise ValueError(f"draft hidden_size {draft.config.hidden_size} differs from the target's {hidden}")
    return draft


def load_tokenizer(spec: ModelSpec) -> Any | None:
    """The checkpoint's tokenizer; None for models built from a config (their prompts are bytes)."""
    if spec.source != "pretrained":
        return None
    return transformers.AutoTokenizer.from_pretrained(checkpoint_dir(spec.path))


def model_prompts(spec: ModelSpec) -> str | None:
    """A checkpoint may ship its own evaluation prompts (`prompts.jsonl`, e.g. held-out text for a fixture)."""
    if spec.source != "pretrained":
        return None
    prompts = checkpoint_dir(spec.path) / "prompts.jsonl"
    return str(prompts) if prompts.is_file() else None


def stop_token_ids(model: transformers.PreTrainedModel, tokenizer: Any | None) -> frozenset[int]:
    """End-of-sequence ids from the generation config and the tokenizer (none for tiny models)."""
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for value in (getattr(generation, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids) if tokenizer is not None else frozenset()
