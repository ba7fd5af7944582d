"""The resolved config as typed values, built once by validation and read by attribute everywhere after.

The worker's own sections (experiment, model, decode, probe) stay plain mappings: they travel as they are
into `spec.json`, where the worker's `remote_worker/spec.py` types and checks them on its side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Command(str, Enum):
    """What `python -m orchestrator` was asked to do (one of them; validation refuses combinations)."""

    RUN = "run"
    DETACH = "detach"
    ATTACH = "attach"
    CANCEL = "cancel"
    LOGS = "logs"
    LIST = "list"


SYNC_METHODS = ("auto", "rsync", "tar")  # host.sync: auto takes rsync when both ends have it, else tar


@dataclass(frozen=True)
class SSHSettings:
    """How to reach an SSH host (conf/host/*.yaml); `~/.ssh/config` fills in what is null here."""

    hostname: str  # an address or a ~/.ssh/config alias
    port: int | None
    user: str | None
    identity_file: str | None
    proxy_jump: str | None  # a gateway host (ProxyJump), e.g. user@bastion
    known_hosts: str
    accept_new_host_key: bool  # remember a first-seen key (a changed key is always refused)
    connect_timeout_s: float
    keepalive_s: float  # an SSH keepalive every keepalive_s...
    keepalive_count_max: int  # ...and the connection is dead after this many go unanswered

    @classmethod
    def from_mapping(cls, host: Mapping[str, Any]) -> SSHSettings:
        """From a resolved `host` section that validation has checked (`config/validation.py`): the keys every
        SSH host file has are required; user, port, key and gateway may be absent, null or empty (not set)."""
        return cls(
            hostname=str(host["hostname"]),
            port=int(host["port"]) if host.get("port") else None,
            user=_optional(host.get("user")),
            identity_file=_optional(host.get("identity_file")),
            proxy_jump=_optional(host.get("proxy_jump")),
            known_hosts=str(host["known_hosts"]),
            accept_new_host_key=bool(host.get("accept_new_host_key", False)),
            connect_timeout_s=float(host["connect_timeout_s"]),
            keepalive_s=float(host["keepalive_s"]),
            keepalive_count_max=int(host["keepalive_count_max"]),
        )


def _optional(value: Any) -> str | None:
    """An optional setting: None when absent, null or empty (as the connection has always read them)."""
    return str(value) if value not in (None, "") else None


@dataclass(frozen=True)
class HostConfig:
    name: str
    kind: str  # local or ssh
    python: str | None
    workdir: str
    env: dict[str, str]
    gpus: str | list[int]  # auto, none, or indices
    gpu_lock_dir: str
    sync: str  # one of SYNC_METHODS
    reconnect_budget_s: float
    ssh: SSHSettings | None  # the connection's settings; None for the local host

    @property
    def is_ssh(self) -> bool:
        return self.ssh is not None

    @property
    def address(self) -> str:
        """What the terminal names the host by: the SSH hostname, or the host config's name."""
        return self.ssh.hostname if self.ssh is not None else self.name

    @classmethod
    def from_mapping(cls, host: Mapping[str, Any]) -> HostConfig:
        """From a resolved `host` section that validation has checked; `sync` and `reconnect_budget_s`, which
        the local host's file leaves out, default to auto and 0."""
        kind = str(host["kind"])
        return cls(
            name=str(host["name"]),
            kind=kind,
            python=host.get("python"),
            workdir=str(host["workdir"]),
            env={str(k): str(v) for k, v in (host.get("env") or {}).items()},
            gpus=host.get("gpus", "none"),
            gpu_lock_dir=str(host["gpu_lock_dir"]),
            sync=str(host.get("sync", "auto")),
            reconnect_budget_s=float(host.get("reconnect_budget_s", 0)),
            ssh=SSHSettings.from_mapping(host) if kind == "ssh" else None,
        )


@dataclass(frozen=True)
class TrackingConfig:
    kind: str  # local or server
    uri: str
    artifact_root: str | None
    timeout_s: float  # one request to the tracking server, retries included
    outage_wait_s: float  # after the worker ended: how long to wait for an unreachable server

    @classmethod
    def from_mapping(cls, tracking: dict[str, Any]) -> TrackingConfig:
        """From the resolved `tracking` section (a job's, or a sweep's before any job)."""
        return cls(
            kind=str(tracking["kind"]),
            uri=str(tracking["uri"]),
            artifact_root=tracking.get("artifact_root"),
            timeout_s=float(tracking["timeout_s"]),
            outage_wait_s=float(tracking["outage_wait_s"]),
        )


@dataclass(frozen=True)
class OrchestratorConfig:
    state_dir: str
    poll_interval_s: float
    kill_grace_s: float
    start_timeout_s: float
    stall_warning_s: float


@dataclass(frozen=True)
class JobConfig:
    command: Command
    run_id: str | None  # for attach, cancel and logs: a run id, a prefix of one, or `last` (see cli.listing.find_run)
    host: HostConfig
    tracking: TrackingConfig
    orchestrator: OrchestratorConfig
    experiment_name: str
    model_name: str
    seed: int
    fail_fast: bool
    resume: bool  # a sweep's job whose settings already FINISHED is not run again (`sweep/resume.py`)
    follow: bool  # logs: keep printing until the worker ends
    list_all: bool  # list: finished runs from MLflow too
    worker_sections: dict[str, Any]  # experiment, model, decode, probe: the spec's content
    resolved: dict[str, Any]  # the whole resolved config, for params and config.yaml (redacted there)
    carried: tuple[str, ...] = ()  # the overrides a printed command repeats (`config/commands.py`)
    yes: bool = False  # cancel=last without asking
    dry_run: bool = False  # sweep.dry_run: check the config (a sweep: every job's) and stop

    @classmethod
    def from_resolved(cls, config: dict[str, Any]) -> JobConfig:
        host, tracking, orch = config["host"], config["tracking"], config["orchestrator"]
        if config["attach"]:
            command, run_id = Command.ATTACH, str(config["attach"])
        elif config["cancel"]:
            command, run_id = Command.CANCEL, str(config["cancel"])
        elif config.get("logs"):
            command, run_id = Command.LOGS, str(config["logs"])
        elif config["list"]:
            command, run_id = Command.LIST, None
        else:
            command, run_id = (Command.DETACH if config["detach"] else Command.RUN), None
        return cls(
            command=command,
            run_id=run_id,
            host=HostConfig.from_mapping(host),
            tracking=TrackingConfig.from_mapping(tracking),
            orchestrator=OrchestratorConfig(
                state_dir=str(orch["state_dir"]),
                poll_interval_s=float(orch["poll_interval_s"]),
                kill_grace_s=float(orch["kill_grace_s"]),
                start_timeout_s=float(orch["start_timeout_s"]),
                stall_warning_s=float(orch["stall_warning_s"]),
            ),
            experiment_name=str(config["experiment"]["name"]),
            model_name=str(config["model"]["name"]),
            seed=int(config["seed"]),
            fail_fast=bool(config["sweep"]["fail_fast"]),
            resume=bool(config["sweep"].get("resume", False)),
            follow=bool(config.get("follow", False)),
            list_all=config["list"] == "all",
            yes=bool(config.get("yes", False)),
            dry_run=bool(config["sweep"].get("dry_run", False)),
            worker_sections={k: config[k] for k in ("experiment", "model", "decode", "probe")},
            resolved=config,
        )
