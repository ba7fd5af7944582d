"""SIGTERM (the orchestrator's stop on Ctrl-C) as a request to stop.

The first SIGTERM is remembered and raised as SystemExit so the worker unwinds and writes its `end` event.
It can land anywhere, even inside an import, where the exception may surface later as something else
(a half-imported module, a RecursionError): the runner therefore asks `requested()`, not the exception
type, to tell a stop from a failure. Further SIGTERMs while unwinding are ignored.
"""

from __future__ import annotations

import signal
from types import FrameType

_requested: int | None = None


def _handle(signum: int, _frame: FrameType | None) -> None:
    global _requested
    if _requested is None:
        _requested = signum
        raise SystemExit(128 + signum)


def install() -> None:
    signal.signal(signal.SIGTERM, _handle)


def requested() -> int | None:
    """The signal that asked the worker to stop, if one did."""
    return _requested


def check() -> None:
    """Raise the stop again where the worker can act on it: the first SystemExit may have been swallowed by
    library code it landed in (an import guarded by a broad `except`), and the work would otherwise go on."""
    if _requested is not None:
        raise SystemExit(128 + _requested)
