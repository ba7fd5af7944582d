"""Where a model's (or draft's) checkpoint can be read on this machine, for the checks made before launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import remote_worker


def local_checkpoint(section: dict[str, Any], local: bool) -> Path | None:
    """The checkpoint folder of a `model` (or `model.draft`) section as this machine can read it: a relative
    path names a fixture inside the worker's package, an absolute one is this machine's only when the host
    is. None for an inline config, or a checkpoint only the host has."""
    if section.get("source") == "config":
        return None
    path = Path(str(section.get("path") or ""))
    if not path.is_absolute():
        return Path(remote_worker.__file__).parent / path
    return path if local else None
