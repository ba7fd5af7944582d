"""A long step that says nothing of itself still says something: `beating` calls a function every few seconds
from a thread while a block runs. Torch-free: the orchestrator's dataset reads use it as the worker's compiles do."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def beating(every: float, beat: Callable[[], None], name: str) -> Iterator[None]:
    """`beat()` every `every` seconds from a daemon thread (`name`) while the block runs; the thread is stopped
    and joined when the block ends, however it ends, so no beat comes after it."""
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every):
            beat()

    ticker = threading.Thread(target=tick, name=name, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
