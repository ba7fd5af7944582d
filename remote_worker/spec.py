"""The spec file: what the orchestrator asks the worker to do. Validated before any work starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remote_worker.safe_files import Folder, UnsafePath

DTYPES = ("float32", "float64", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
MODEL_SOURCES = ("config", "pretrained")
# The experiments `remote_worker.experiments.EXPERIMENTS` implements (kept here: this module needs no torch).
EXPERIMENT_NAMES = ("ddtree_gdn", "node_cost", "probe")


class SpecError(ValueError):
    """The spec is malformed; the message names the offending key."""


@dataclass(frozen=True)
class DraftSpec:
    source: str
    config: dict[str, Any]
    path: str | None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    arch: str
    dtype: str
    device: str
    config: dict[str, Any]
    path: str | None
    draft: DraftSpec | None = None


@dataclass(frozen=True)
class Spec:
    run_id: str
    run_dir: Path
    seed: int
    experiment: dict[str, Any]
    model: ModelSpec
    decode: dict[str, Any]
    probe: dict[str, Any]

    @property
    def experiment_name(self) -> str:
        return str(self.experiment["name"])


def _require(section: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in section:
        raise SpecError(f"spec: missing key {where}{key}")
    value = section[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise SpecError(f"spec: {where}{key}={value!r} has the wrong type")
    return value


def _choice(section: dict[str, Any], key: str, where: str, allowed: tuple[str, ...]) -> str:
    value = _require(section, key, where, str)
    if value not in allowed:
        raise SpecError(f"spec: {where}{key}={value!r} is not one of: {', '.join(allowed)}")
    return value


def parse_spec(raw: dict[str, Any], run_dir: Path) -> Spec:
    """Check the spec's structure and build a `Spec`; `run_dir` is the folder holding the spec file."""
    if not isinstance(raw, dict):
        raise SpecError("spec: the top level must be a JSON object")
    model = _require(raw, "model", "", dict)
    source = _choice(model, "source", "model.", MODEL_SOURCES)
    path = model.get("path")
    if source == "pretrained" and not path:
        raise SpecError("spec: model.path is required when model.source='pretrained'")
    draft = model.get("draft")
    draft_spec = None
    if draft:
        if not isinstance(draft, dict):
            raise SpecError("spec: model.draft must be a mapping")
        draft_source = _choice(draft, "source", "model.draft.", MODEL_SOURCES)
        if draft_source == "pretrained" and not draft.get("path"):
            raise SpecError("spec: model.draft.path is required when model.draft.source='pretrained'")
        draft_spec = DraftSpec(
            source=draft_source, config=dict(draft.get("config") or {}), path=draft.get("path") or None
        )
    model_spec = ModelSpec(
        name=_require(model, "name", "model.", str),
        source=source,
        arch=_require(model, "arch", "model.", str),
        dtype=_choice(model, "dtype", "model.", DTYPES),
        device=_choice(model, "device", "model.", DEVICES),
        config=dict(model.get("config") or {}),
        path=str(path) if path else None,
        draft=draft_spec,
    )
    declared = Path(_require(raw, "run_dir", "", str))
    if declared.resolve() != run_dir.resolve():
        raise SpecError(f"spec: run_dir={str(declared)!r} is not the folder of the spec file ({run_dir})")
    experiment = _require(raw, "experiment", "", dict)
    _require(experiment, "name", "experiment.", str)
    return Spec(
        run_id=_require(raw, "run_id", "", str),
        run_dir=run_dir,
        seed=_require(raw, "seed", "", int),
        experiment=experiment,
        model=model_spec,
        decode=dict(raw.get("decode") or {}),
        probe=dict(raw.get("probe") or {}),
    )


def load_spec(path: Path) -> Spec:
    try:
        data = Folder(path.resolve().parent).read(path.name)  # the spec itself is never a link's target
        if data is None:
            raise SpecError(f"spec: {path} does not exist")
        raw = json.loads(data)
    except UnsafePath as exc:
        raise SpecError(f"spec: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise SpecError(f"spec: {path} is not valid JSON: {exc}") from exc
    return parse_spec(raw, path.resolve().parent)  # absolute: the worker is started as `run spec.json`
