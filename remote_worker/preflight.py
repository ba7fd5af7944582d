"""What a host offers, as one JSON line, checked before anything is copied or launched there.

The orchestrator runs this file's source with the host's interpreter (`python -c SOURCE ARGS`), so it
needs nothing on the host yet and writes nothing there (whether the work dir is writable is asked of the
kernel, `os.access` and `os.statvfs`, never tried). It imports only the standard library at the top,
so it answers even where torch or transformers are missing: that absence is one of its answers.

Every job of a sweep starts with this check, so it is kept cheap: the packages are found and their versions
read from their installed metadata, none imported (importing torch and transformers costs seconds of CPU);
torch is imported only where a GPU driver is loaded, to list the GPUs it sees. The worker imports them all
at its start, where a broken install fails with its traceback.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from typing import Any

GIB = 1024**3


# Where one of these exists a GPU driver is loaded (NVIDIA's, WSL2's GPU bridge, Jetson's, ROCm's): without
# any, torch sees no GPU, and its import (seconds) is skipped. A false "yes" only costs that import.
GPU_DRIVERS = (
    "/proc/driver/nvidia/version",
    "/dev/nvidiactl",
    "/dev/dxg",
    "/dev/nvhost-ctrl-gpu",
    "/dev/nvgpu",
    "/dev/kfd",
)


def _version(module: str) -> str | None:
    """The installed version of a top-level package the interpreter can import, None where it cannot."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
        return importlib.metadata.version(module)
    except Exception:  # noqa: BLE001 - any failure to find it means "not usable here"
        return None


def _torch_cuda() -> str | None:
    """The CUDA release torch was built for (`torch.version.cuda`), read from its version file, not imported."""
    try:
        version_file = os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "version.py")
        with open(version_file, encoding="utf-8") as file:
            tree = ast.parse(file.read())
        for node in tree.body:  # `cuda: Optional[str] = '12.8'` (or a plain assignment)
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "cuda" for t in targets) and node.value is not None:
                return ast.literal_eval(node.value)
    except Exception:  # noqa: BLE001 - an unreadable version file says nothing of CUDA
        return None
    return None


def workdir_report(workdir: str) -> dict[str, Any]:
    """Whether the run can write under `workdir`, found without writing anything.

    The work dir may not exist yet: then its nearest existing ancestor is checked, where it will be created.
    `workdir_problem` is None, "read-only file system", "permission denied" or "not a directory".
    """
    checked = os.path.abspath(workdir)
    while not os.path.exists(checked):
        checked = os.path.dirname(checked)
    directory = checked if os.path.isdir(checked) else os.path.dirname(checked)
    problem = None
    if directory != checked:
        problem = "not a directory"
    elif not os.access(checked, os.W_OK | os.X_OK):  # False with EROFS on a read-only mount, even for root
        read_only = bool(os.statvfs(checked).f_flag & os.ST_RDONLY)
        problem = "read-only file system" if read_only else "permission denied"
    return {
        "workdir_free_gib": round(shutil.disk_usage(directory).free / GIB, 2),
        "workdir_checked": checked,
        "workdir_writable": problem is None,
        "workdir_problem": problem,
    }


def preflight(workdir: str, paths: dict[str, str]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "safetensors": _version("safetensors"),
        "numpy": _version("numpy"),
        "gpus": [],
        "cuda": None,
        "flock": shutil.which("flock") is not None,
    }
    if report["torch"]:
        report["cuda"] = _torch_cuda()
    if report["torch"] and any(os.path.exists(path) for path in GPU_DRIVERS):
        import torch

        report["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(index)
                report["gpus"].append(
                    {
                        "index": index,
                        "name": torch.cuda.get_device_name(index),
                        "free_gib": round(free / GIB, 2),
                        "total_gib": round(total / GIB, 2),
                    }
                )
    report.update(workdir_report(workdir))
    report["paths"] = {name: os.path.isfile(os.path.join(path, "config.json")) for name, path in paths.items()}
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="preflight")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("paths", nargs="*", help="NAME=DIR checkpoint directories that must hold a config.json")
    args = parser.parse_args(argv)
    print(json.dumps(preflight(args.workdir, dict(item.split("=", 1) for item in args.paths))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
