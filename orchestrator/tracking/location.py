"""Where a run lives, as the run itself records it: its host's connection and work folder.

A run's tags name its host (`host`), how it was reached (`host.hostname`, `host.port`, `host.user`,
`host.gateway`: never a key or a secret) and its work folder (`host.workdir`); `host.run_dir` is added when
its folder is written on the host. `attach=`, `cancel=` and `logs=` of a run take these from the run, so the
command a run prints works from any folder and any shell, whatever `host.*` overrides started it. An
override given on the command line that disagrees with the run's record is refused, naming both: it would
look for the run where it is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from orchestrator.config.settings import HostConfig, JobConfig
from orchestrator.config.validation import ConfigError
from orchestrator.tracking import tags

# tag → (the command line's key, the field of HostConfig or of its SSHSettings)
_RECORDED = {
    tags.HOST_WORKDIR: ("host.workdir", "workdir"),
    tags.HOST_HOSTNAME: ("host.hostname", "hostname"),
    tags.HOST_PORT: ("host.port", "port"),
    tags.HOST_USER: ("host.user", "user"),
    tags.HOST_GATEWAY: ("host.proxy_jump", "proxy_jump"),
}


def location_tags(host: HostConfig) -> dict[str, str]:
    """The tags that say where a run of `host` lives (what is not set is not recorded)."""
    values: dict[str, object] = {"workdir": host.workdir}
    if host.ssh is not None:
        ssh = host.ssh
        values.update(hostname=ssh.hostname, port=ssh.port, user=ssh.user, proxy_jump=ssh.proxy_jump)
    return {tag: str(values[field]) for tag, (_, field) in _RECORDED.items() if values.get(field) is not None}


def _current(host: HostConfig, field: str) -> object:
    if field == "workdir":
        return host.workdir
    return getattr(host.ssh, field) if host.ssh is not None else None


def located(config: JobConfig, run_id: str, run_tags: Mapping[str, str]) -> JobConfig:
    """`config` with its host placed where the run `run_id` says it lives.

    The host must be the run's own (`host=`); each recorded setting replaces the config's, unless the
    command line set it to something else (`config.host_overrides`): then a one-line ConfigError names both."""
    ran_on = run_tags.get(tags.HOST)
    if ran_on is not None and ran_on != config.host.name:
        raise ConfigError(f"run {run_id[:8]} ran on host {ran_on!r}, not {config.host.name!r}: pass host={ran_on}")
    host, ssh = config.host, config.host.ssh
    for tag, (key, field) in _RECORDED.items():
        recorded = run_tags.get(tag)
        if recorded is None or str(_current(host, field)) == recorded:
            continue
        if key in config.host_overrides:
            raise ConfigError(
                f"run {run_id[:8]} lives at {key}={recorded} (its own record); the command line's "
                f"{key}={_current(host, field)} disagrees: leave it out"
            )
        if field == "workdir":
            host = replace(host, workdir=recorded)
        elif ssh is not None:
            ssh = replace(ssh, **{field: int(recorded) if field == "port" else recorded})
    return replace(config, host=replace(host, ssh=ssh))
