"""The tiny models of conf/model/, built once per (name, dtype) for the worker's tests."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from omegaconf import OmegaConf

from orchestrator import CONF_DIR
from remote_worker.models.dflash import DFlashDraft
from remote_worker.models.loading import load_drafter, load_model
from remote_worker.models.target import TargetModel
from remote_worker.spec import ModelSpec, parse_spec

TINY_MODELS = ("tiny_hybrid", "tiny_dense", "tiny_qwen3_next")


def model_spec(name: str, dtype: str) -> ModelSpec:
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    model.update(dtype=dtype, device="cpu")
    raw = {"run_id": "t", "run_dir": "/", "seed": 0, "experiment": {"name": "probe"}, "model": model}
    return parse_spec(raw, Path("/")).model


@cache
def tiny(name: str, dtype: str = "float32") -> tuple[TargetModel, DFlashDraft]:
    spec = model_spec(name, dtype)
    model = load_model(spec, seed=0)
    return TargetModel(model), load_drafter(spec, seed=0, target=model)


def random_prompt(seed: int, vocab: int = 512) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 + seed)
    length = 4 + seed % 13
    return torch.randint(0, vocab - 1, (length,), generator=generator)
