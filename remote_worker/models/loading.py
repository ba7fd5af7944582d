"""Build a target model from a spec: a seeded tiny model from an inline config, or a checkpoint directory.

A checkpoint is checked against the GPU's free memory before any weight is read, and loaded straight onto
its device (`device_map`, where the host has `accelerate`; without it transformers loads into host memory
first, and the worker says so). Qwen3.5/3.6 checkpoints are saved by the multimodal class; the text-only
`Qwen3_5ForCausalLM` loads them without the vision tower, with the same logits.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import torch
import transformers

from remote_worker.models.dflash import DFlashDraft, build_draft, draft_config, load_draft
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


# Checkpoint tensors a text-only class never loads: the vision tower and multi-token-prediction heads.
_NOT_TEXT = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_FLOAT_KINDS = ("F64", "F32", "BF16", "F16")  # loaded in the model's dtype
_INT_BYTES = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}  # loaded as they are


def checkpoint_bytes(path: Path, dtype: torch.dtype, text_only: bool) -> int:
    """Bytes the checkpoint's floating-point weights take in `dtype`, read from the safetensors headers only."""
    size = torch.finfo(dtype).bits // 8
    total = 0
    for shard in sorted(path.glob("*.safetensors")):
        with shard.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__" or (text_only and name.startswith(_NOT_TEXT)):
                continue
            numel = 1
            for dim in entry["shape"]:
                numel *= int(dim)
            kind = entry["dtype"]
            total += numel * (size if kind in _FLOAT_KINDS else _INT_BYTES.get(kind, 1))
    return total


class CheckpointCorrupt(ValueError):
    """A checkpoint file is unreadable: truncated, not JSON, or named by the index but absent."""


def check_checkpoint(path: Path, what: str) -> None:
    """Read every file a load would read, headers only, and name the first broken one and its directory.

    Left to them, transformers and safetensors say `Error while deserializing header: MetadataIncompleteBuffer`
    or `Expecting value: line 1 column 1` and name no file: an interrupted copy of a 50 GB checkpoint then
    costs an hour to find. Only the headers are read (a few KiB per shard), so this costs nothing next to the
    load."""

    def broken(name: str, why: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{what}: {name} in {path} {why}; copy the checkpoint again")

    for name in ("config.json", "model.safetensors.index.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            document = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise broken(name, f"is not valid JSON ({error})") from error
        if not isinstance(document, dict):
            raise broken(name, "is not a JSON object")
        if name.endswith(".index.json"):
            for shard in sorted(set((document.get("weight_map") or {}).values())):
                if not (path / shard).is_file():
                    raise broken(shard, "is missing (model.safetensors.index.json names it)")
    for shard in sorted(path.glob("*.safetensors")):
        size = shard.stat().st_size
        with shard.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise broken(shard.name, f"is truncated ({size} bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise broken(shard.name, f"is truncated ({size} bytes; its header alone claims {length})")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise broken(shard.name, "has an unreadable header (not a safetensors file?)") from error
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
        needed = 8 + length + max(ends, default=0)
        if size < needed:
            raise broken(shard.name, f"is truncated ({size} bytes of {needed})")


class CheckpointTooLarge(RuntimeError):
    """The checkpoint's weights alone exceed the device's free memory (found before loading any)."""


def check_fits(needed: int, free: int, device: torch.device, what: str) -> None:
    """One clear line, before any weight is copied, when the weights alone exceed the device's free memory."""
    if needed > free:
        gib = 1 << 30
        raise CheckpointTooLarge(
            f"{what}: {needed / gib:.1f} GiB of weights do not fit the {free / gib:.1f} GiB free on {device}"
        )


def _free_memory(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None  # host memory: the operating system's business
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def cast_like_a_checkpoint(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast a model built in float32 (so one seed gives the same weights in every dtype), keeping the rotary
    frequencies in float32 as a checkpoint loaded by transformers keeps them: cast to bfloat16 they would
    shift every position's rotation, and tiny models would not behave as real checkpoints do."""
    frequencies = {name: b.clone() for name, b in model.named_buffers() if name.rsplit(".", 1)[-1].endswith("inv_freq")}
    model.to(dtype)
    for name, value in frequencies.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, value)
    return model


def load_model(spec: ModelSpec, seed: int) -> transformers.PreTrainedModel:
    """Return the model in eval mode, on its device, in its dtype."""
    return eager_experts_in_float64(_load_model(spec, seed))


def eager_experts_in_float64(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """A float64 mixture of experts gets transformers' eager expert loop: the grouped kernel it picks by
    default refuses float64 ('Expected mat_a to be Float32, BFloat16 or Float16')."""
    text = model.config.get_text_config()
    if next(model.parameters()).dtype == torch.float64 and getattr(text, "num_experts", 0):
        model.set_experts_implementation("eager")
    return model


def _load_model(spec: ModelSpec, seed: int) -> transformers.PreTrainedModel:
    cls = model_class(spec.arch)
    dtype = DTYPES[spec.dtype]
    device = resolve_device(spec.device)
    if spec.source == "config":
        config = cls.config_class(**spec.config)
        torch.manual_seed(seed)
        return cast_like_a_checkpoint(cls(config), dtype).to(device).eval()
    path = checkpoint_dir(spec.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json (model.path)")
    check_checkpoint(path, f"model {spec.name}")
    if spec.draft is not None and spec.draft.source == "pretrained":
        check_checkpoint(checkpoint_dir(spec.draft.path), f"model {spec.name}'s draft")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    free = _free_memory(device)
    if free is not None:
        needed = checkpoint_bytes(path, dtype, text_only=not spec.arch.endswith("ForConditionalGeneration"))
        draft = spec.draft.path if spec.draft is not None and spec.draft.source == "pretrained" else None
        if draft:
            needed += checkpoint_bytes(checkpoint_dir(draft), dtype, text_only=False)
        check_fits(needed, free, device, f"model {spec.name} ({path}{' and its draft' if draft else ''})")
    if has_accelerate():
        return cls.from_pretrained(path, dtype=dtype, device_map=str(device)).eval()
    return cls.from_pretrained(path, dtype=dtype).to(device).eval()


def has_accelerate() -> bool:
    """transformers needs `accelerate` to load weights straight onto a device."""
    return importlib.util.find_spec("accelerate") is not None


def context_length(model: transformers.PreTrainedModel) -> int | None:
    """The model's context in tokens (max_position_embeddings of its text config), when it says."""
    config = model.config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def load_drafter(spec: ModelSpec, seed: int, target: transformers.PreTrainedModel) -> DFlashDraft:
    """The model's DFlash drafter, on the target's device and in its dtype."""
    if spec.draft is None:
        raise ValueError(f"model {spec.name} has no draft (model.draft)")
    parameter = next(target.parameters())
    if spec.draft.source == "config":
        draft = build_draft(spec.draft.config, seed, parameter.dtype, parameter.device)
    else:
        folder = checkpoint_dir(spec.draft.path)
        if (folder / "config.json").is_file():  # (load_draft says so when it is not)
            check_checkpoint(folder, f"model {spec.name}'s draft")
        draft = load_draft(folder, parameter.dtype, parameter.device)
    hidden = target.get_input_embeddings().embedding_dim
    if draft.config.hidden_size != hidden:
        raise ValueError(f"draft hidden_size {draft.config.hidden_size} differs from the target's {hidden}")
    return draft


def draft_config_values(spec: ModelSpec) -> dict[str, Any] | None:
    """The draft's config as the drafter would build it (its checkpoint's config.json or the inline config,
    resolved by the config class, e.g. a window dropped without `use_sliding_window`), weights not loaded."""
    if spec.draft is None:
        return None
    values = dict(spec.draft.config)
    if spec.draft.source != "config":
        path = checkpoint_dir(spec.draft.path) / "config.json"
        if not path.is_file():
            return None
        values = json.loads(path.read_text(encoding="utf-8"))
    return draft_config(values).to_dict()


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
