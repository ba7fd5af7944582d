"""Where a run lives, as its tags claim it, checked against what the user's own config says.

A run's tags record its host (`host`), how it was reached (`host.hostname`, `host.port`, `host.user`,
`host.gateway`: never a key or a secret), its work folder (`host.workdir`) and, once launched, its folder
(`host.run_dir`). A tracking server may have no authentication, so these are hints, never authorities:

- the connection comes from the user's host config (`host=<name>`) and the command line alone. A recorded
  value that differs, or that is not a valid value at all, is one line of notice; it is never followed (a
  forged host name would otherwise be dialled with the user's keys and agent);
- the work folder is the configured one; a run that records another is refused in one line naming both
  (the printed commands carry `host.workdir=` when the run was launched with one), and the run's folder is
  always `host.workdir/runs/<run id>`, whatever `host.run_dir` says;
- every value is read with the same schema as the command line's (`config/host_values.py`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.config import host_values
from orchestrator.config.settings import HostConfig, JobConfig
from orchestrator.config.text import printable, shown
from orchestrator.config.validation import ConfigError
from orchestrator.tracking import tags

HOST_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a host config's name (conf/host/<name>.yaml)

# tag → (the command line's key, the field of SSHSettings, its check on the tag's text)
_CONNECTION = {
    tags.HOST_HOSTNAME: ("host.hostname", "hostname", host_values.hostname),
    tags.HOST_PORT: ("host.port", "port", host_values.parse_port),
    tags.HOST_USER: ("host.user", "user", host_values.user),
    tags.HOST_GATEWAY: ("host.proxy_jump", "proxy_jump", host_values.gateway),
}


def location_tags(host: HostConfig) -> dict[str, str]:
    """The tags that say where a run of `host` lives (what is not set is not recorded)."""
    recorded = {tags.HOST_WORKDIR: host.workdir}
    if host.ssh is not None:
        for tag, (_, name, _) in _CONNECTION.items():
            value = getattr(host.ssh, name)
            if value is not None:
                recorded[tag] = str(value)
    return recorded


@dataclass(frozen=True)
class Located:
    """A run's record checked: the lines to tell the user before acting (a record that differs from the config,
    a value that is not valid), and the run's folder (always in the configured work folder)."""

    run_dir: str
    notes: list[str] = field(default_factory=list)


def located(config: JobConfig, run_id: str, run_tags: Mapping[str, str]) -> Located:
    """Check the run's record against `config`; refuse (ConfigError, one line) what cannot be this host's
    run in this work folder, and note what differs in how it was reached."""
    short = run_id[:8]
    ran_on = run_tags.get(tags.HOST)
    if ran_on is not None and ran_on != config.host.name:
        if not HOST_NAME.fullmatch(ran_on):
            raise ConfigError(f"run {short}: its tag host={shown(ran_on)} is not a host's name; not this host's run")
        raise ConfigError(f"run {short} ran on host {ran_on!r}, not {config.host.name!r}: pass host={ran_on}")
    workdir = config.host.workdir
    recorded = run_tags.get(tags.HOST_WORKDIR)
    if recorded is not None and recorded != workdir:
        try:
            host_values.folder(recorded)
        except ValueError as exc:
            raise ConfigError(f"run {short}: its tag host.workdir={shown(recorded)} {exc}; nothing was done") from exc
        given = shlex.quote(f"host.workdir={recorded}")  # a tag anyone could write: pasted, it stays a word
        raise ConfigError(
            f"run {short} records host.workdir={printable(recorded)}; this command's is {workdir}. A tag is never "
            f"followed: give {printable(given)} if that is where you launched it"
        )
    run_dir = host_values.run_dir_for(workdir, run_id)
    notes = []
    claimed = run_tags.get(tags.HOST_RUN_DIR)
    if claimed is not None and claimed != run_dir:
        notes.append(
            f"run {short}: its tag host.run_dir={shown(claimed)} is not its folder in host.workdir; using {run_dir}"
        )
    notes += _connection_notes(config, short, run_tags)
    return Located(run_dir, notes)


def _connection_notes(config: JobConfig, short: str, run_tags: Mapping[str, str]) -> list[str]:
    notes = []
    ssh = config.host.ssh
    for tag, (key, name, check) in _CONNECTION.items():
        recorded = run_tags.get(tag)
        if recorded is None:
            continue
        try:
            value = check(recorded)
        except ValueError as exc:
            notes.append(f"run {short}: its tag {tag}={shown(recorded)} {exc}; ignored")
            continue
        current = getattr(ssh, name) if ssh is not None else None
        if value != current:
            now = f"{key}={current}" if current is not None else f"no {key}"
            notes.append(
                f"run {short} was launched with {key}={value}; connecting with {now} "
                f"(host {config.host.name}'s config and the command line: a tag is never followed)"
            )
    return notes
