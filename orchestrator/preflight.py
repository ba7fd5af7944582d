"""Preflight: check the host before anything is copied or started there, and say what is missing."""

from __future__ import annotations

import json
from typing import Any

from orchestrator import PROJECT_ROOT
from orchestrator.transport import Transport

REQUIRED = ("torch", "transformers", "safetensors", "numpy")
MIN_FREE_GIB = 1.0
SCRIPT = PROJECT_ROOT / "remote_worker" / "preflight.py"


class PreflightFailed(RuntimeError):
    """The host lacks something the run needs; the message names the host and the missing piece."""


def checkpoint_paths(model: dict[str, Any]) -> dict[str, str]:
    """The directories the run will load from on the host, by what they are for."""
    paths = {}
    if model["source"] == "pretrained":
        paths["model.path"] = str(model["path"])
    draft = model.get("draft") or {}
    if draft.get("source") == "pretrained":
        paths["model.draft.path"] = str(draft["path"])
    # A relative path names a fixture shipped inside the worker's package: it travels with the code.
    return {key: path for key, path in paths.items() if path.startswith("/")}


def run_preflight(transport: Transport, host: dict[str, Any], model: dict[str, Any], python: str) -> dict[str, Any]:
    name = host["name"]
    paths = checkpoint_paths(model)
    argv = [python, "-c", SCRIPT.read_text(encoding="utf-8"), "--workdir", host["workdir"]]
    result = transport.run([*argv, *(f"{key}={path}" for key, path in paths.items())], check=False)
    if result.exit_code == 127:
        raise PreflightFailed(f"{name}: the interpreter {python} does not exist there (host.python)")
    lines = result.stdout.strip().splitlines()
    if not result.ok or not lines:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise PreflightFailed(f"{name}: {python} could not run the preflight check: {detail}")
    report = json.loads(lines[-1])
    missing = [module for module in REQUIRED if not report.get(module)]
    if missing:
        raise PreflightFailed(
            f"{name}: {python} cannot import {', '.join(missing)} (the worker needs {', '.join(REQUIRED)})"
        )
    for key, present in report["paths"].items():
        if not present:
            raise PreflightFailed(f"{name}: {key} {paths[key]} is missing or has no config.json")
    if report["workdir_free_gib"] < MIN_FREE_GIB:
        raise PreflightFailed(f"{name}: only {report['workdir_free_gib']} GiB free for host.workdir {host['workdir']}")
    if model["device"] == "cuda" and not report["gpus"]:
        raise PreflightFailed(f"{name}: model.device=cuda but torch sees no GPU there (CUDA {report['cuda']})")
    if lease_candidates(host, report) and not report.get("flock"):
        raise PreflightFailed(f"{name}: GPU leases need the flock command (util-linux) on the host")
    return report


def lease_candidates(host: dict[str, Any], report: dict[str, Any]) -> list[int]:
    """The GPUs a run may lease: host.gpus, with `auto` meaning every GPU the preflight saw."""
    gpus = host.get("gpus", "none")
    if gpus == "auto":
        return [int(g["index"]) for g in report["gpus"]]
    return [] if gpus == "none" else [int(g) for g in gpus]
