"""What the host offers: interpreter, torch, CUDA, GPUs with their memory, transformers."""

from __future__ import annotations

import platform
import socket
import sys
from typing import Any

import torch
import transformers

GIB = 1024**3


def gpu_inventory() -> list[dict[str, Any]]:
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(
            {
                "index": index,
                "name": torch.cuda.get_device_name(index),
                "total_gib": round(total / GIB, 2),
                "free_gib": round(free / GIB, 2),
            }
        )
    return gpus


def probe_environment() -> dict[str, Any]:
    gpus = gpu_inventory() if torch.cuda.is_available() else []
    return {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cuda_available": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "gpu_count": len(gpus),
        "gpus": gpus,
    }


def environment_tags(env: dict[str, Any]) -> dict[str, str]:
    """The MLflow tags DESIGN.md names for the remote side (remote python/torch/transformers/CUDA/GPU)."""
    gpus = "; ".join(f"{g['index']}: {g['name']} ({g['free_gib']}/{g['total_gib']} GiB free)" for g in env["gpus"])
    return {
        "remote.hostname": env["hostname"],
        "remote.python": env["python"],
        "remote.torch": env["torch"],
        "remote.transformers": env["transformers"],
        "remote.cuda": env["cuda"],
        "remote.gpus": gpus or "none",
    }
