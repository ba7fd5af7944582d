"""Where commands run and files live: one small interface, a local implementation (Invoke) here.

Every command is an argv list, joined with `shlex.join` at this one place, so no value from the config is
ever read by a shell as syntax.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from invoke import Context

from orchestrator.errors import Interrupted


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

    def read_bytes(self, path: str, offset: int, limit: int) -> bytes:
        """Up to `limit` bytes of `path` from `offset`; empty when there is nothing new (or no file yet)."""

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        """Create or replace `path` with `data`, readable only as `mode` allows from the start."""

    def make_dirs(self, path: str, mode: int) -> None: ...

    def fetch(self, path: str, local_path: Path) -> bool:
        """Copy `path` to `local_path`; False when it does not exist."""

    def prepare_code(self, workdir: str, method: str) -> tuple[str, bool]:
        """Where the worker's code is on the host (its PYTHONPATH), and whether anything was copied there.

        The hook each kind of host answers its own way: this machine runs the checkout itself, an SSH host
        gets a content-addressed snapshot (`sync.py`)."""

    def close(self) -> None: ...


class LocalTransport:
    """This machine, through Invoke's local runner."""

    def __init__(self, name: str = "local") -> None:
        self.name = name
        self._context = Context()

    def open(self) -> None:
        return None

    def reconnect(self) -> None:
        return None

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> CommandResult:
        result = self._context.run(
            shlex.join(argv), hide=True, warn=True, in_stream=False, env=dict(env or {}), pty=False
        )
        if result.exited == -signal.SIGINT:
            # The terminal's Ctrl-C reaches the whole process group, this command included: it did not fail,
            # it was interrupted (over SSH the remote command never sees it).
            raise Interrupted("interrupted by the user (Ctrl-C)")
        return command_result(argv, result.exited, result.stdout, result.stderr, check)

    def read_bytes(self, path: str, offset: int, limit: int) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(limit)
        except FileNotFoundError:
            return b""

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, mode)

    def make_dirs(self, path: str, mode: int) -> None:
        os.makedirs(path, mode=mode, exist_ok=True)
        os.chmod(path, mode)

    def fetch(self, path: str, local_path: Path) -> bool:
        if not os.path.isfile(path):
            return False
        shutil.copyfile(path, local_path)
        return True

    def prepare_code(self, workdir: str, method: str) -> tuple[str, bool]:
        from orchestrator import PROJECT_ROOT

        return str(PROJECT_ROOT), False

    def close(self) -> None:
        return None
