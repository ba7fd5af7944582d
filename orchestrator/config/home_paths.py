"""`~` and `$HOME` in the local path settings a user types on the command line.

Hydra's override grammar has no `~` (`experiment.datasets_dir=~/hf-datasets` stops with a lexer error), and a
shell leaves `~` alone after `make run ARGS="..."` or inside quotes. The local path settings are expanded
here, on this machine, before Hydra reads them, and handed on quoted for Hydra's grammar. A host's paths
(`host.workdir`, `host.python`, `model.path`) are the host's to resolve and are left as typed.
"""

from __future__ import annotations

import os
import re

LOCAL_PATH_KEYS = (
    "experiment.datasets_dir",
    "experiment.prompts",
    "orchestrator.state_dir",
    "host.identity_file",
    "host.known_hosts",
)
_VARIABLE = re.compile(r"\$(\w+|\{\w+\})")  # $HOME, ${HOME}; never Hydra's ${group:key} interpolations


def _hydra_quoted(value: str) -> str:
    """`value` as one quoted string of Hydra's override grammar: a quote escaped, and the backslashes before a
    quote or the closing quote doubled (elsewhere Hydra takes a backslash as it is)."""
    escaped = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return f"'{escaped}'"


def _expanded(value: str) -> str:
    value = _VARIABLE.sub(lambda match: os.environ.get(match.group(1).strip("{}"), match.group(0)), value)
    return os.path.expanduser(value)


def expand_local_paths(args: list[str]) -> list[str]:
    """The command line's overrides, a local path setting's leading `~` and its `$VARIABLE`s expanded here."""
    out = []
    for arg in args:
        key, equals, value = arg.partition("=")
        bare = key.lstrip("+~")
        quoted = value[:1] in ("'", '"')
        if equals and bare in LOCAL_PATH_KEYS and not quoted and (value.startswith("~") or "$" in value):
            expanded = _expanded(value)
            if expanded != value:
                arg = f"{key}={_hydra_quoted(expanded)}"
        out.append(arg)
    return out
