"""`experiment=probe`: environment, model structure and cache behaviour, as MLflow answers and probe.json."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from remote_worker.events import EventLog
from remote_worker.models.layout import layout_params
from remote_worker.models.loading import draft_config_values, load_model
from remote_worker.models.target import TargetModel
from remote_worker.probes.cache_behaviour import probe_cache
from remote_worker.probes.environment import probe_environment
from remote_worker.probes.hybrid_cache_check import check_hybrid_cache
from remote_worker.probes.model_structure import probe_model
from remote_worker.safe_files import Folder
from remote_worker.spec import Spec

LOG = logging.getLogger(__name__)
PROBE_FILE = "probe.json"


def split_answers(report: dict[str, Any], prefix: str) -> tuple[dict[str, str], dict[str, float]]:
    """Flatten a report into MLflow params (text, flags, lists) and metrics (numbers), by dotted key."""
    params: dict[str, str] = {}
    metrics: dict[str, float] = {}
    for key, value in report.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict) and value and all(isinstance(v, int) for v in value.values()):
            params[name] = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, dict):
            sub_params, sub_metrics = split_answers(value, name)
            params.update(sub_params)
            metrics.update(sub_metrics)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[name] = float(value)
        elif isinstance(value, list):
            params[name] = ", ".join(map(str, value)) or "none"
        else:
            params[name] = str(value)
    return params, metrics


def summarize(report: dict[str, Any]) -> dict[str, str]:
    """The few answers worth a line in the terminal; everything else is in MLflow and probe.json."""
    model, cache = report["model"], report["cache"]
    summary = {
        "model": f"{model['class']} ({model['num_parameters']:,} parameters, {model['dtype']})",
        "layers": ", ".join(f"{k}={v}" for k, v in model["layer_type_counts"].items()),
        "cache reports croppable": str(cache["reports_croppable"]),
        "native crop": cache["native_crop"]["result"],
    }
    for name in ("native_crop", "recording_crop"):
        if "logits_max_abs_diff" in cache.get(name, {}):
            summary[f"{name.replace('_', ' ')}: max |Δ logits|"] = f"{cache[name]['logits_max_abs_diff']:.3g}"
    hybrid = report["hybrid_cache"]
    summary["hybrid cache: tree verify max |Δ|"] = f"{hybrid['tree_verify_max_abs_diff']:.3g}"
    summary["hybrid cache: commit max |Δ logits|"] = f"{hybrid['commit_logits_max_abs_diff']:.3g}"
    bound, scale = hybrid["rounding_bound"], hybrid["logits_scale"]
    summary["hybrid cache: rounding bound"] = f"{bound:.3g} (logits up to {scale:.3g})"
    summary["hybrid cache exact"] = hybrid["exact"]
    return summary


def run_probe(spec: Spec, log: EventLog) -> dict[str, str]:
    steps = 5
    prefill = int(spec.probe.get("prefill_tokens", 16))
    crop = int(spec.probe.get("crop_tokens", 4))

    log.progress("probe", 0, steps, "environment")
    report: dict[str, Any] = {"environment": probe_environment()}

    log.progress("probe", 1, steps, f"loading {spec.model.name}")
    model = load_model(spec.model, spec.seed)
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(spec.seed)
    input_ids = torch.randint(0, vocab, (1, prefill), generator=generator).to(device)

    log.progress("probe", 2, steps, "model structure")
    report["model"] = probe_model(model, input_ids)
    report["model"]["name"] = spec.model.name
    layout, uncovered = layout_params(model, draft_config_values(spec.model), spec.model.source == "pretrained")
    log.emit("params", layout)
    report["layout"] = layout
    if uncovered:
        LOG.warning("%s", uncovered)

    log.progress("probe", 3, steps, "cache behaviour")
    report["cache"] = probe_cache(model, input_ids, crop)

    log.progress("probe", 4, steps, "hybrid-aware cache")
    tree_size = int(spec.probe.get("tree_size", 16))
    report["hybrid_cache"] = check_hybrid_cache(TargetModel(model), input_ids[0], tree_size, spec.seed)

    for section in ("model", "cache", "hybrid_cache"):
        params, metrics = split_answers(report[section], f"probe.{section}")
        log.emit("params", params)
        log.emit("metrics", metrics, step=0)
    Folder(spec.run_dir).write_whole(PROBE_FILE, (json.dumps(report, indent=2) + "\n").encode())
    log.emit("artifact", {"path": PROBE_FILE})
    log.progress("probe", steps, steps, "done")
    return summarize(report)
