"""A real OpenSSH server for the tests (on 127.0.0.1 unless told): generated host and client keys, known_hosts."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.settings import HostConfig

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@dataclass(frozen=True)
class SSHServer:
    address: str
    port: int
    user: str
    client_key: Path
    known_hosts: Path
    host_public_key: str
    process: subprocess.Popen

    def host_overrides(self) -> list[str]:
        """Hydra overrides pointing host=localhost_ssh at this server."""
        return [
            "host=localhost_ssh",
            f"host.hostname={self.address}",
            f"host.port={self.port}",
            f"host.user={self.user}",
            f"host.identity_file={self.client_key}",
            f"host.known_hosts={self.known_hosts}",
        ]

    def host_config(self, workdir: Path, **changes: object) -> HostConfig:
        """A resolved SSH host config for this server, typed as the orchestrator's transport takes it."""
        config = {
            "name": "localhost_ssh",
            "kind": "ssh",
            "hostname": self.address,
            "user": self.user,
            "port": self.port,
            "identity_file": str(self.client_key),
            "proxy_jump": None,
            "known_hosts": str(self.known_hosts),
            "accept_new_host_key": False,
            "python": sys.executable,
            "workdir": str(workdir),
            "env": {},
            "gpus": "none",
            "gpu_lock_dir": str(workdir / "locks"),
            "connect_timeout_s": 10,
            "keepalive_s": 2,
            "keepalive_count_max": 3,
            "sync": "auto",
            "reconnect_budget_s": 30,
        }
        config.update(changes)
        return HostConfig.from_mapping(config)

    def connection_pids(self) -> list[int]:
        """The per-connection sshd processes (children of the listener)."""
        out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


def sshd_available() -> str | None:
    """None when a server can be started here, else the reason it cannot."""
    if not Path(SSHD).is_file():
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is not installed"
    return None


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_sshd(root: Path, address: str = "127.0.0.1", prefix: Sequence[str] = ()) -> SSHServer:
    """Start sshd listening on `address`; `prefix` wraps the command (e.g. `ip netns exec NS`)."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    _keygen(root / "host_key")
    _keygen(root / "client_key")
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    os.chmod(root / "authorized_keys", 0o600)
    port = _free_port()
    user = getpass.getuser()
    config = root / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                f"ListenAddress {address}",
                f"HostKey {root / 'host_key'}",
                f"PidFile {root / 'sshd.pid'}",
                f"AuthorizedKeysFile {root / 'authorized_keys'}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                "Subsystem sftp internal-sftp",
                "MaxStartups 50:30:100",
                "MaxSessions 50",
                "LogLevel ERROR",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
    host_public_key = (root / "host_key.pub").read_text().split()
    known_hosts = root / "known_hosts"
    known_hosts.write_text(f"[{address}]:{port} {host_public_key[0]} {host_public_key[1]}\n")
    log = (root / "sshd.log").open("wb")
    process = subprocess.Popen([*prefix, SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        with socket.socket() as sock:
            if sock.connect_ex((address, port)) == 0:
                break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"sshd did not start: {(root / 'sshd.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return SSHServer(address, port, user, root / "client_key", known_hosts, " ".join(host_public_key[:2]), process)


def stop_sshd(server: SSHServer) -> None:
    for pid in server.connection_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
