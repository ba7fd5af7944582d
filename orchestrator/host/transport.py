"""Where commands run and files live: one small interface, and what its implementations raise.

The implementations are `local.LocalTransport` (this machine, through Invoke) and `ssh.SSHTransport` (Fabric);
`connect.transport_for` is the one place that picks one, and nothing after it asks which kind it holds.
Every command is an argv list, joined with `shlex.join` where it is run, so no value from the config is
ever read by a shell as syntax.
"""

from __future__ import annotations

import posixpath
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import paramiko

from remote_worker.safe_files import UnsafePath


class Interrupted(Exception):
    """The user asked to stop (Ctrl-C, or `cancel`).

    Defined here, in the lowest layer that raises it: a local command that the terminal's Ctrl-C killed
    raises it, as does the `cancel` command above; `lifecycle/errors.py` gives it its meaning."""


def inside(root: str, path: str) -> str:
    """`path` relative to the folder `root`; UnsafePath when it is not inside it (the layer's one rule for what
    a host's file operations may touch: the work folder the user configured, nothing a tag or a file names)."""
    base = posixpath.normpath(root)
    target = posixpath.normpath(path)
    if not target.startswith("/") or ".." in path.split("/"):
        raise UnsafePath(f"{path[:200]} is not an absolute path inside {base}; not used")
    if base == "/":
        return target.lstrip("/")
    if not target.startswith(base + "/"):
        raise UnsafePath(f"{path[:200]} is outside the work folder {base}; not used")
    return target[len(base) + 1 :]


# What a lost or refused connection raises, in paramiko (SFTP included) and below it (OSError, which a local
# file operation may raise too). Callers catch these names, never a transport's class: they are the
# interface's failure vocabulary, whichever transport `connect.transport_for` picked.
CONNECTION_ERRORS = (paramiko.SSHException, paramiko.sftp.SFTPError, socket.error, EOFError, OSError)


class ConnectionLost(paramiko.SSHException):
    """The channel closed before the command reported its exit status."""


class HostKeyRefused(paramiko.SSHException):
    """The host's key is not in known_hosts and the host config does not accept new keys."""


class ConnectFailed(paramiko.SSHException):
    """No SSH session could be opened; the message names the host setting to look at."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class CommandFailed(RuntimeError):
    def __init__(self, argv: Sequence[str], result: CommandResult) -> None:
        detail = (result.stderr or result.stdout).strip().splitlines()
        super().__init__(f"`{shlex.join(argv)}` exited {result.exit_code}: {detail[-1] if detail else 'no output'}")
        self.result = result


def command_result(argv: Sequence[str], exit_code: int, stdout: str, stderr: str, check: bool) -> CommandResult:
    """The outcome of a finished command; raises CommandFailed for a non-zero exit when `check`."""
    outcome = CommandResult(exit_code, stdout, stderr)
    if check and not outcome.ok:
        raise CommandFailed(argv, outcome)
    return outcome


class Transport(Protocol):
    """What the launcher and the streamer need from a host."""

    name: str

    def open(self) -> None:
        """Connect (a no-op where there is nothing to connect to)."""

    def reconnect(self) -> None:
        """Drop the connection and open a new one."""

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> CommandResult:
        """Run a command to completion; raise `CommandFailed` on a non-zero exit when `check`.

        `env` is for plain settings only: over SSH it travels as `env K=V` arguments, which the host's process
        list shows. Secrets reach the worker through `worker.env` (see `launch.start_worker`)."""

    # The safe file layer (`remote_worker/safe_files.py`): every path is absolute and inside the host's work
    # folder; each component below the work folder is reached without following a link, and anything but a
    # regular file is refused (`UnsafePath`, one line). No caller opens a run folder's file any other way.

    def read_bytes(self, path: str, offset: int, limit: int) -> bytes:
        """Up to `limit` bytes of `path` from `offset`; empty when there is nothing new (or no file yet)."""

    def file_size(self, path: str) -> int | None:
        """The size of the regular file `path`; None when there is none."""

    def write_file(self, path: str, data: bytes, mode: int, *, exclusive: bool = False) -> None:
        """Create or replace `path` with `data` whole (a scratch file renamed onto the name: a link standing
        there is replaced, never written through), readable only as `mode` allows from the start.
        `exclusive`: `path` is a new file of the caller's own that nobody reads while it is written (a sync's
        archive): created in place with O_EXCL, failing where any entry of that name exists."""

    def create_file(self, path: str, data: bytes, mode: int) -> bool:
        """Create `path` with `data` only if nothing of that name exists (a link counts); True if it did."""

    def make_dirs(self, path: str, mode: int) -> None:
        """Create `path` and the folders on its way below the work folder; a link on the way is refused."""

    def fetch(self, path: str, local_path: Path) -> bool:
        """Copy the regular file `path` to `local_path`; False when it does not exist."""

    # True where `prepare_code` answers a snapshot in the work folder, which others who may write that folder
    # could swap: the supervisor then holds it open and checks it again as the worker starts (`launch.py`).
    # False for this machine's own checkout, run as it is.
    code_snapshot: bool

    def prepare_code(self, workdir: str, method: str, owner: str = "") -> tuple[str, bool]:
        """Where the worker's code is on the host (its PYTHONPATH), and whether anything was copied there.
        `owner` (the run's id) names a partial copy, for `sync.remove_abandoned_parts`.

        The hook each kind of host answers its own way: this machine runs the checkout itself, an SSH host
        gets a content-addressed snapshot (`host/sync.py`)."""

    def close(self) -> None: ...
