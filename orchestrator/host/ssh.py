"""SSH hosts through Fabric: the same `Transport` interface as the local host.

Host keys are checked: the known_hosts file is loaded and an unknown key is refused, unless the host config
opts into accept-new (the key is then remembered in that file; a changed key is always refused). Fabric's
default of adding any key silently is never used. Commands are argv lists joined with `shlex.join`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import paramiko
from fabric import Connection

from orchestrator.config import host_values
from orchestrator.config.settings import HostConfig, SSHSettings
from orchestrator.config.text import printable
from orchestrator.host.ssh_files import SSHFiles
from orchestrator.host.sync import sync_code
from orchestrator.host.transport import (
    CONNECTION_ERRORS,
    CommandResult,
    ConnectFailed,
    ConnectionLost,
    HostKeyRefused,
    command_result,
)


def _connect_failure(host: SSHSettings, error: Exception) -> ConnectFailed:
    where = f"{host.hostname}:{host.port or 22}"
    if isinstance(error, paramiko.AuthenticationException):
        user = host.user or "the default user"
        return ConnectFailed(f"{where} refused {user} ({error}); check host.user and host.identity_file")
    if isinstance(error, paramiko.ssh_exception.NoValidConnectionsError):
        reasons = sorted({e.strerror or str(e) for e in error.errors.values()})
        return ConnectFailed(f"cannot reach {where} ({'; '.join(reasons)}); check host.hostname and host.port")
    if isinstance(error, TimeoutError):
        return ConnectFailed(f"no answer from {where} within {host.connect_timeout_s:g}s (host.connect_timeout_s)")
    if isinstance(error, socket.gaierror):
        return ConnectFailed(f"cannot resolve {host.hostname} ({error.strerror}); check host.hostname")
    return ConnectFailed(f"cannot connect to {where}: {type(error).__name__}: {error}")


def _changed_key(known_hosts: str, port: int, error: paramiko.BadHostKeyException) -> HostKeyRefused:
    """The host offered a key other than the one known_hosts holds for it: one line with the fix.

    The entry to remove is named as known_hosts names it: the address paramiko dialled (`error.hostname`, an
    ssh-config alias already resolved to its HostName) and, off port 22, in brackets with the port. Naming the
    alias or the configured port instead would give an `ssh-keygen -R` that removes nothing."""
    entry = error.hostname if port == 22 else f"[{error.hostname}]:{port}"
    return HostKeyRefused(
        f"{entry}: host key CHANGED (now {error.key.get_name()} {error.key.fingerprint}; reinstalled, or someone "
        f"in the middle). If the host's owner confirms it: `ssh-keygen -f {shlex.quote(known_hosts)} -R "
        f"{shlex.quote(entry)}`, then connect again"
    )


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: Path, port: int) -> None:
        self.known_hosts, self.port = known_hosts, port

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        """Refused, with how to verify the key (never a bare "trust it"): the fingerprint from the host's owner
        or over a path you trust, compared before the key goes into known_hosts."""
        address = _bare_host(hostname)
        raise HostKeyRefused(
            f"{printable(hostname)}: unknown host key ({key.get_name()} {key.fingerprint}) is not in "
            f"{self.known_hosts}. Verify it before trusting it: compare the fingerprint with the one the host's "
            f"owner reads on the host (`ssh-keygen -lf /etc/ssh/ssh_host_{_key_file(key)}_key.pub`), or with "
            f"`ssh-keyscan -p {self.port} {shlex.quote(address)} | ssh-keygen -lf -` run over a network path you "
            f"trust; then add that verified key to {self.known_hosts}"
        )


def _bare_host(hostname: str) -> str:
    """The address in paramiko's known_hosts form (`host` or `[host]:port`)."""
    return hostname[1:].rsplit("]:", 1)[0] if hostname.startswith("[") else hostname


def _key_file(key: paramiko.PKey) -> str:
    """The host key file's name part for the key's type (ssh_host_<this>_key.pub)."""
    name = key.get_name()
    return "ed25519" if "ed25519" in name else "ecdsa" if "ecdsa" in name else "rsa"


def known_hosts_entry(hostname: str) -> str:
    """`hostname` as it may go into known_hosts: a valid host name (`host_values.hostname`), or one in
    brackets with a port; anything else (a newline, a pattern such as `*`) raises HostKeyRefused."""
    host, port = hostname, None
    if hostname.startswith("["):
        host, _, port = hostname[1:].rpartition("]:")
    try:
        host_values.hostname(host)
        if port is not None:
            host_values.parse_port(port)
    except ValueError as exc:
        raise HostKeyRefused(f"{printable(hostname)[:80]!r} {exc}: its key is not written into known_hosts") from exc
    return hostname


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """OpenSSH's accept-new: remember a first-seen key; a changed key still fails (paramiko checks that)."""

    def __init__(self, known_hosts: Path) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        hostname = known_hosts_entry(hostname)  # nothing unchecked is written into known_hosts
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self.known_hosts.open("a", encoding="utf-8") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def connection_for(host: SSHSettings) -> Connection:
    """A Fabric connection for the host config; ~/.ssh/config aliases, users, ports, keys and ProxyJump apply."""
    connect_kwargs: dict[str, Any] = {
        "banner_timeout": host.connect_timeout_s,
        "auth_timeout": host.connect_timeout_s,
        "allow_agent": True,
        "look_for_keys": host.identity_file is None,
    }
    if host.identity_file:
        connect_kwargs["key_filename"] = os.path.expanduser(host.identity_file)
    gateway = None
    if host.proxy_jump:
        gateway = Connection(host.proxy_jump, connect_timeout=host.connect_timeout_s)
        _check_host_keys(gateway, host)
    connection = Connection(
        host.hostname,
        user=host.user,
        port=host.port,
        connect_timeout=host.connect_timeout_s,
        connect_kwargs=connect_kwargs,
        gateway=gateway,
    )
    _check_host_keys(connection, host)
    return connection


def _check_host_keys(connection: Connection, host: SSHSettings) -> None:
    known_hosts = Path(os.path.expanduser(host.known_hosts))
    client = connection.client
    if known_hosts.exists():
        client.load_host_keys(str(known_hosts))
    port = int(connection.port or 22)
    policy = _AcceptNew(known_hosts) if host.accept_new_host_key else _RefuseUnknown(known_hosts, port)
    client.set_missing_host_key_policy(policy)


def _detect_dead_links(connection: Connection, host: SSHSettings) -> None:
    """Keepalives every `keepalive_s`, and the connection closed after `keepalive_count_max` go unanswered.

    paramiko sends keepalives but never gives up on a silent peer: over a cut link every read would block
    forever. Like OpenSSH's ServerAliveInterval/ServerAliveCountMax, the connection must die instead; here
    the kernel does it (TCP_USER_TIMEOUT: unacknowledged data past the limit resets the socket), and every
    blocked command or SFTP read then fails with a connection error the follower reconnects from.
    """
    transport = connection.client.get_transport()
    if transport is None:
        return
    interval = host.keepalive_s
    transport.set_keepalive(max(1, round(interval)))
    sock = transport.sock
    if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
        limit_ms = int(interval * host.keepalive_count_max * 1000)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, limit_ms)


class SSHTransport:
    def __init__(self, host: HostConfig) -> None:
        if host.ssh is None:
            raise ValueError(f"host {host.name} is not an SSH host (host.kind={host.kind})")
        self.name = host.name
        self.host = host
        self.ssh: SSHSettings = host.ssh
        self._connection = connection_for(self.ssh)
        self._sftp: paramiko.SFTPClient | None = None
        self._files = SSHFiles(self, host.workdir)
        self._opened = False  # open() succeeded and close() has not been called since

    # -- connection --------------------------------------------------------------------------------

    def open(self) -> None:
        try:
            self._connection.open()
        except HostKeyRefused:
            raise
        except paramiko.BadHostKeyException as changed:  # not a network blip: no reconnect would change it
            known_hosts = os.path.expanduser(self.ssh.known_hosts)
            raise _changed_key(known_hosts, self._port_of(changed.hostname), changed) from changed
        except CONNECTION_ERRORS as error:
            raise _connect_failure(self.ssh, error) from error
        _detect_dead_links(self._connection, self.ssh)
        if isinstance(self._connection.gateway, Connection):
            _detect_dead_links(self._connection.gateway, self.ssh)
        self._opened = True

    def _port_of(self, address: str) -> int:
        """The port dialled for `address`: the gateway's when it is the gateway's host (ProxyJump), else the
        target's, each as the ssh config resolved it."""
        gateway = self._connection.gateway
        if isinstance(gateway, Connection) and gateway.host == address and self._connection.host != address:
            return int(gateway.port or 22)
        return int(self._connection.port or 22)

    def reconnect(self) -> None:
        self.close()
        self._connection = connection_for(self.ssh)
        self.open()

    @property
    def connected(self) -> bool:
        """Whether the SSH connection is up: a command then runs without opening a new one."""
        return bool(self._connection.is_connected)

    def sftp_client(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            if not self._connection.is_connected:
                self.open()
            self._sftp = self._connection.sftp()
        return self._sftp

    def close(self) -> None:
        self._opened = False
        if self._sftp is not None:
            with contextlib.suppress(*CONNECTION_ERRORS):
                self._sftp.close()
            self._sftp = None
        self._connection.close()

    def openssh_command(self) -> list[str]:
        """The OpenSSH client command for tools that bring their own transport (rsync), with the same
        user, port, key, host-key policy, gateway and keepalives as this connection; never prompting."""
        host = self.ssh
        argv = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={max(1, round(host.connect_timeout_s))}",
            "-o",
            f"ServerAliveInterval={max(1, round(host.keepalive_s))}",
            "-o",
            f"ServerAliveCountMax={host.keepalive_count_max}",
            "-o",
            f"UserKnownHostsFile={os.path.expanduser(host.known_hosts)}",
            "-o",
            f"StrictHostKeyChecking={'accept-new' if host.accept_new_host_key else 'yes'}",
        ]
        if host.port:
            argv += ["-p", str(host.port)]
        if host.user:
            argv += ["-l", host.user]
        if host.identity_file:
            argv += ["-i", os.path.expanduser(host.identity_file), "-o", "IdentitiesOnly=yes"]
        if host.proxy_jump:
            argv += ["-J", host.proxy_jump]
        return argv

    @property
    def hostname(self) -> str:
        """The host as the OpenSSH client and rsync name it (user, port and key travel as options)."""
        return self.ssh.hostname

    # -- the Transport interface -----------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> CommandResult:
        if not self._connection.is_connected:
            self.open()  # ours, not Fabric's implicit one: keepalives and the dead-link limit must apply
        command = shlex.join(["env", *(f"{k}={v}" for k, v in (env or {}).items()), *argv] if env else argv)
        result = self._connection.run(command, hide=True, warn=True, in_stream=False, pty=False)
        if result.exited == -1:  # paramiko's "no exit status": the connection went away mid-command
            raise ConnectionLost(f"{self.name}: connection lost while running `{argv[0]}`")
        return command_result(argv, result.exited, result.stdout, result.stderr, check)

    # -- the safe file layer (`ssh_files.py`), inside host.workdir -------------------------------------------

    def read_bytes(self, path: str, offset: int, limit: int) -> bytes:
        return self._files.read(path, offset, limit)

    def file_size(self, path: str) -> int | None:
        return self._files.size(path)

    def write_file(self, path: str, data: bytes, mode: int, *, exclusive: bool = False) -> None:
        if exclusive:
            self._files.write_new(path, data, mode)
        else:
            self._files.write_whole(path, data, mode)

    def create_file(self, path: str, data: bytes, mode: int) -> bool:
        return self._files.create(path, data, mode)

    def make_dirs(self, path: str, mode: int) -> None:
        self._files.make_dirs(path, mode)

    def fetch(self, path: str, local_path: Path) -> bool:
        return self._files.fetch(path, local_path)

    def exec_bytes(self, argv: Sequence[str], sink: Callable[[bytes], None] | None = None) -> tuple[int, bytes, str]:
        """Run `argv` on a channel of its own; (exit code, stdout as bytes, stderr). With `sink`, stdout goes
        there chunk by chunk instead (a fetched file is never held whole in memory)."""
        if not self._connection.is_connected:
            if self._opened:  # it was up, and went away: a loss the caller reconnects from (and says so)
                raise ConnectionLost(f"{self.name}: connection lost")
            self.open()
        link = self._connection.client.get_transport()
        if link is None or not link.is_active():
            raise ConnectionLost(f"{self.name}: connection lost")
        channel = link.open_session()
        try:
            channel.exec_command(shlex.join(argv))
            channel.shutdown_write()
            out = bytearray()
            while chunk := channel.recv(1 << 20):
                if sink is not None:
                    sink(chunk)
                else:
                    out += chunk
            err = b""
            while more := channel.recv_stderr(1 << 16):
                err += more
            code = channel.recv_exit_status()
        finally:
            channel.close()
        if code == -1:  # no exit status: the connection went away mid-command
            raise ConnectionLost(f"{self.name}: connection lost while running `{argv[0]}`")
        return code, bytes(out), err.decode(errors="replace")

    def sftp_write(self, path: str, data: bytes, mode: int, flags: str = "wb") -> None:
        """Write in chunks, pipelined; an interrupted write drops the connection instead of closing the file.

        Closing an SFTP file waits for every pipelined write's acknowledgement: over a slow or cut link after
        Ctrl-C that could take minutes. So on KeyboardInterrupt (any BaseException that is not an Exception),
        or on an error with the link already down, the SSH transport is shut without a word to the peer (its
        socket closed, nothing waited for) and the next command reconnects. An error the server answered
        with (no space, permission) leaves the link up: the file is then closed as usual.
        """
        chunk = 1 << 20
        sftp = self.sftp_client()
        f: paramiko.SFTPFile | None = None
        try:
            f = sftp.open(path, flags)
            f.chmod(mode)
            f.set_pipelined(True)  # without it every 32 KiB write waits for its acknowledgement
            for start in range(0, len(data), chunk):
                f.write(data[start : start + chunk])
            f.close()
        except BaseException as error:
            link = self._connection.client.get_transport()
            if isinstance(error, Exception) and link is not None and link.is_active():
                if f is not None:
                    with contextlib.suppress(*CONNECTION_ERRORS):
                        f.close()
                with contextlib.suppress(*CONNECTION_ERRORS):
                    sftp.remove(path)  # the scratch file a failed write leaves
            else:
                with contextlib.suppress(Exception):
                    if link is not None:
                        link.close()  # closes the socket; sends nothing, waits for nothing
                with contextlib.suppress(Exception):
                    self.close()  # now only forgets the SFTP session and the connection
            raise

    code_snapshot = True  # WORKDIR/code/<hash> (`sync.py`)

    def prepare_code(self, workdir: str, method: str, owner: str = "") -> tuple[str, bool]:
        return sync_code(self, workdir, method=method, owner=owner)
