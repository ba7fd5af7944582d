"""The one hook that picks the kind of host: everything after it holds a `Transport` and never asks which."""

from __future__ import annotations

from orchestrator.config.settings import HostConfig
from orchestrator.host.local import LocalTransport
from orchestrator.host.ssh import SSHTransport
from orchestrator.host.transport import Transport


def transport_for(host: HostConfig) -> Transport:
    """An SSH host's Fabric connection (not yet opened), or this machine."""
    if host.ssh is not None:
        return SSHTransport(host)
    return LocalTransport(host.name, host.workdir)
