"""`decode.compile_cache`: torch's compile caches in the host's work folder, shared by every run there.

A compiled round costs its compile once per host, not once per run: inductor's FX graph cache (the
generated code of every graph and region) and AOT autograd's cache live under `WORKDIR/compile-cache/`,
next to `WORKDIR/runs/`, not in `/tmp` (which a reboot clears) nor in one run's folder. Torch keys every
entry on what decides the code (the graph, its inputs' shapes, dtypes and strides, torch's version and
configuration, the device), so runs of other models, shapes or torch builds share the folder without
meeting; a second run of the same model and shapes traces its graphs (seconds) and loads the rest.

Off (`decode.compile_cache: false`), both caches are disabled and the kernels go to a scratch folder in
the run's own folder: a cold compile, nothing from another run used or left for one.

The folder is group-writable with its group inherited (mode 2775), and while compiling the worker writes
with umask 002 (restored afterwards: nothing else of the run becomes group-writable), so the runs of
every user of a shared work folder in one group use one cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch._dynamo.utils import counters

FOLDER = "compile-cache"


def cache_folder(run_dir: Path) -> Path:
    """`WORKDIR/compile-cache/inductor` for a run in `WORKDIR/runs/<id>/` (the worker is started in its run
    folder: a relative `.` would have no parents)."""
    return run_dir.resolve().parent.parent / FOLDER / "inductor"


def _tally() -> tuple[int, int]:
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return hits, misses


@dataclass
class CompileCache:
    """Where this run's compiles read and write (`folder`), and how many of them the cache answered."""

    folder: Path
    enabled: bool
    _start: tuple[int, int] = (0, 0)

    @classmethod
    @contextmanager
    def open(cls, run_dir: Path, enabled: bool) -> Iterator[CompileCache]:
        """Torch's caches pointed at the host's folder (or, off, at a scratch folder of the run) for the
        compiles inside the `with` (inductor reads TORCHINDUCTOR_CACHE_DIR as it compiles; the process's
        own setting comes back afterwards)."""
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        folder = cache_folder(run_dir) if enabled else run_dir / "inductor-scratch"
        old_mask, old_folder = os.umask(0o002), os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if not enabled:
            os.umask(old_mask)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for part in (folder.parent, folder) if enabled else ():
                if part.stat().st_uid == os.getuid():
                    part.chmod(0o2775)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
            inductor_config.fx_graph_cache = enabled
            functorch_config.enable_autograd_cache = enabled
            yield cls(folder, enabled, _tally())
        finally:
            os.umask(old_mask)
            if old_folder is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old_folder

    def outcome(self) -> str:
        """What the cache did for the compiles since `open`: `hit` (it answered every graph), `miss` (none),
        `partial` (some: a new method, budget or shape compiled beside cached ones), or `off`."""
        if not self.enabled:
            return "off"
        hits, misses = (now - then for now, then in zip(_tally(), self._start, strict=True))
        if hits and not misses:
            return "hit"
        return "partial" if hits else "miss"
