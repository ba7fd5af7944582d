"""This machine as a host: commands through Invoke's local runner, files through the file system."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from invoke import Context

from orchestrator.config.paths import PROJECT_ROOT
from orchestrator.host.transport import CommandResult, Interrupted, command_result


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

    def prepare_code(self, workdir: str, method: str, owner: str = "") -> tuple[str, bool]:
        return str(PROJECT_ROOT), False

    def close(self) -> None:
        return None
