"""Ctrl-C that cannot be lost.

Invoke swallows a KeyboardInterrupt raised while one of its commands runs (it forwards it to the command
and carries on), and the orchestrator is inside such a command most of the time. So SIGINT also sets a
flag, which the follow loop checks between commands; once the stop has begun, further Ctrl-C only says so.
"""

from __future__ import annotations

import signal
from types import FrameType

from rich.console import Console


class CtrlC:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.requested = False
        self._previous: object = None

    def __enter__(self) -> CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested = True
        raise KeyboardInterrupt

    def _already_stopping(self, _signum: int, _frame: FrameType | None) -> None:
        self.console.print("[yellow]already stopping the worker; please wait[/yellow]")

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed while a command swallowed it."""
        if self.requested:
            raise KeyboardInterrupt

    def stopping(self) -> None:
        """From now on Ctrl-C must not interrupt the clean-up."""
        signal.signal(signal.SIGINT, self._already_stopping)
