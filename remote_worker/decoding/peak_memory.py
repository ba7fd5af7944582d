"""A decode's peak memory, reset before each decode so that each method's figure is its own.

On CUDA it is `torch.cuda.max_memory_allocated`: the tensors' peak (weights included, the allocator's cache
not). On a CPU it is the worker process's peak resident size (`VmHWM` in /proc/self/status, reset by writing
5 to /proc/self/clear_refs): every page the process touched, weights, torch's own buffers and the Python heap
with them, so a tree's extra bytes show only where they exceed the allocator's reuse. `MEASURES` names which
one a run's figures are, beside them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

MEASURES = {
    "cuda": "torch.cuda.max_memory_allocated during the decode (tensors, weights included)",
    "cpu": "the worker process's peak resident size during the decode (VmHWM: every page it touched)",
}
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


def measures(device: torch.device) -> str | None:
    """What `peak_bytes` measures on `device`, or None where it measures nothing."""
    if device.type == "cuda":
        return MEASURES["cuda"]
    return MEASURES["cpu"] if STATUS.exists() else None


def reset(device: torch.device) -> None:
    """Start a new peak at the present use."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the peak is then the process's since it began
        CLEAR_REFS.write_text("5")


def peak_bytes(device: torch.device) -> int | None:
    """The peak since the last `reset` (see the module); None where nothing is measured."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
