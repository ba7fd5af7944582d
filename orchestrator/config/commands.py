"""The commands the tool prints (attach, cancel, logs of a run): whole, and working as printed from any folder.

A printed command names the project's own entry point by its full path (the `ddtree-orch` console script the
editable install puts beside the interpreter, else that interpreter with `-m orchestrator`), and carries every
setting it needs: the host by name, the `host.*` and `orchestrator.state_dir` overrides this command was
given (never `host.env.*`, which may hold secrets), and the tracking store (its address without credentials).
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.config.redaction import redact_url
from orchestrator.config.settings import JobConfig

CONSOLE_SCRIPT = "ddtree-orch"
CARRIED_PREFIXES = ("host.", "orchestrator.state_dir")  # what a printed command repeats of the command line
NEVER_CARRIED = ("host.env",)  # the worker's environment: secrets, and of no use to attach, cancel or logs


_PLAIN = re.compile(r"[\w./:@+,-]+")  # a value Hydra reads as typed, needing no quotes in a shell either


def carried(overrides: list[str], resolved: Mapping[str, Any]) -> tuple[str, ...]:
    """The command line's overrides a printed command must repeat: `key=value` with the value it resolved to
    where that is plain text, else as it was typed (Hydra's quotes and all)."""
    kept = []
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if not key.startswith(CARRIED_PREFIXES) or key.startswith(NEVER_CARRIED):
            continue
        value: Any = resolved
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        plain = isinstance(value, (str, int)) and not isinstance(value, bool) and _PLAIN.fullmatch(str(value))
        kept.append(f"{key}={value}" if plain else override)
    return tuple(kept)


def entry_point() -> list[str]:
    """The project's command by its full path: the console script where the environment has it."""
    script = Path(sys.executable).parent / CONSOLE_SCRIPT
    return [str(script)] if script.is_file() else [sys.executable, "-m", "orchestrator"]


def command_line(config: JobConfig, verb: str, run_id: str) -> str:
    """`<entry point> <verb>=<run id> host=<name> <carried overrides> tracking=<kind> tracking.uri=<uri>`."""
    return shlex.join(
        [
            *entry_point(),
            f"{verb}={run_id}",
            f"host={config.host.name}",
            *config.carried,
            f"tracking={config.tracking.kind}",
            f"tracking.uri={redact_url(config.tracking.uri)}",
        ]
    )


def attach_command(config: JobConfig, run_id: str) -> str:
    """The command that resumes following `run_id` (same host and tracking, from the state saved so far)."""
    return command_line(config, "attach", run_id)


def cancel_command(config: JobConfig, run_id: str) -> str:
    """The command that stops `run_id`'s worker and ends the run."""
    return command_line(config, "cancel", run_id)
