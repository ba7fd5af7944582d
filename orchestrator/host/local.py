"""This machine as a host: commands through Invoke's local runner, files through the file system."""

from __future__ import annotations

import shlex
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from invoke import Context

from orchestrator.config.paths import PROJECT_ROOT
from orchestrator.host.transport import CommandResult, Interrupted, command_result, inside
from remote_worker.safe_files import Folder


class LocalTransport:
    """This machine, through Invoke's local runner."""

    def __init__(self, name: str = "local", workdir: str = "/") -> None:
        """`workdir`: the folder every file operation stays inside (the host's work folder; tests that touch
        files anywhere give none, and then every component of a path is reached without following a link)."""
        self.name = name
        self._context = Context()
        self._folder = Folder(workdir)

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

    # -- the safe file layer: `remote_worker/safe_files.py` below the work folder ---------------------------------

    def _file(self, path: str) -> str:
        return inside(self._folder.root, path)

    def read_bytes(self, path: str, offset: int, limit: int) -> bytes:
        return self._folder.read(self._file(path), offset, limit) or b""

    def file_size(self, path: str) -> int | None:
        return self._folder.size(self._file(path))

    def write_file(self, path: str, data: bytes, mode: int, *, exclusive: bool = False) -> None:
        if exclusive:
            self._folder.write_new(self._file(path), data, mode)
        else:
            self._folder.write_whole(self._file(path), data, mode)

    def create_file(self, path: str, data: bytes, mode: int) -> bool:
        return self._folder.create(self._file(path), data, mode)

    def make_dirs(self, path: str, mode: int) -> None:
        self._folder.make_dirs(self._file(path), mode)

    def fetch(self, path: str, local_path: Path) -> bool:
        return self._folder.copy_to(self._file(path), local_path)

    code_snapshot = False  # the checkout itself

    def prepare_code(self, workdir: str, method: str, owner: str = "") -> tuple[str, bool]:
        return str(PROJECT_ROOT), False

    def close(self) -> None:
        return None
