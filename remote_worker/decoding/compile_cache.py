"""`decode.compile_cache`: torch's compile caches in the host's work folder, private to the user.

A compiled round costs its compile once per host, not once per run: inductor's FX graph cache (the
generated code of every graph) and AOT autograd's cache live under `WORKDIR/compile-cache.<user>/`, next to
`WORKDIR/runs/`, not in `/tmp` (which a reboot clears) nor in one run's folder. Torch keys every entry on what
decides the code (graph, shapes, dtypes, strides, torch's version and configuration, device), so runs of
other models or shapes share the folder without meeting; a second run of the same model and shapes traces
its graphs (seconds) and loads the rest.

What the cache holds runs: on a hit inductor imports the cached `.py` modules, loads the `.so` kernels and
unpickles the entries, inside a worker whose environment holds `host.env`'s secrets. So the folder is the
user's alone: created 0700, written under umask 077 (files 0600, kernels 0700), and checked before each use,
every entry in it (owner the user, no group or other write bit, no link). A folder that fails the check, is
read-only or full is not used: the run says so in one line and compiles cold in its own scratch folder. One
that fills up during the compile: the run compiles once more, cold, in a private folder of the system's
temporary space (often another disk), removed when the worker ends (`ddtree_gdn._compiled_rounds`).
The folder checked is the folder used: it is opened once (O_NOFOLLOW), checked through that handle, and the
compiles reach it through the handle's path in /proc, so a copy put in its place in the work folder after the
check is never read.

Sharing with a group is an explicit choice, `decode.compile_cache_group=<group>`: the folder is then
`compile-cache.group-<group>/`, mode 2770, written under umask 007, and every entry must belong to that group
and be writable by no one else. Anyone in the group can then put code into every member's worker.

Off (`decode.compile_cache: false`), both caches are disabled and the kernels go to the run's own scratch
folder: a cold compile, nothing from another run used or left for one.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch._dynamo.utils import counters

from remote_worker.safe_files import UnsafePath, folder_problem, tree_problem

LOG = logging.getLogger(__name__)
SCRATCH = "inductor-scratch"
LOW_SPACE_MB = 256  # free space under which a failed compile is put down to the disk being full
SILENCE = "decode.compile_cache=false silences this"


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def cache_root(run_dir: Path, group: str | None = None) -> Path:
    """`WORKDIR/compile-cache.<user>` (or `.group-<group>`) for a run in `WORKDIR/runs/<id>/` (the worker is
    started in its run folder: a relative `.` would have no parents)."""
    name = f"compile-cache.group-{group}" if group else f"compile-cache.{_user()}"
    return run_dir.resolve().parent.parent / name


def cache_folder(run_dir: Path, group: str | None = None) -> Path:
    return cache_root(run_dir, group) / "inductor"


def _tally() -> tuple[int, int]:
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return hits, misses


def _group_id(group: str) -> int:
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError as missing:
        raise UnsafePath(f"decode.compile_cache_group={group}: no such group on this host") from missing
    if gid != os.getegid() and gid not in os.getgroups():
        raise UnsafePath(f"decode.compile_cache_group={group}: you are not a member of it")
    return gid


@dataclass(frozen=True)
class HeldFolder:
    """The cache folder, held open: `path` reaches it through the open descriptor (`/proc/<pid>/fd/<n>/inductor`),
    so renaming or replacing `compile-cache.<user>` in the work folder after the check changes nothing this run
    reads or writes; `shown` is its name, for messages."""

    fd: int
    path: Path
    shown: Path


def _hold(root: Path) -> int:
    """`root` opened as a folder, never through a link (O_NOFOLLOW): the handle every check and use goes through."""
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{root} is a symbolic link") from exc
        if exc.errno == errno.ENOTDIR:
            raise UnsafePath(f"{root} is not a folder") from exc
        raise UnsafePath(f"{root} could not be opened: {_cause(exc)}") from exc


def prepare(run_dir: Path, group: str | None = None) -> HeldFolder:
    """The cache folder, made if missing, opened once and checked whole through that handle; UnsafePath (one
    line) when it may not be used: another owner or group, a write bit for others, a link, or a folder it
    cannot write (read-only, full). The caller closes `fd` when its compiles are done.

    The check and the use read the same folder: the check walks the tree below the open descriptor, and the
    compiles reach it by the descriptor's path in /proc (inductor's worker processes too: the path names this
    process), not by its name in the work folder, which anyone who may write the work folder could swap."""
    gid = _group_id(group) if group else None
    root = cache_root(run_dir, group)
    mode = 0o2770 if gid is not None else 0o700
    try:
        root.mkdir(mode=mode)
        if gid is not None:
            os.chown(root, -1, gid)
            root.chmod(mode)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafePath(f"{root} could not be made: {_cause(exc)}") from exc
    fd = _hold(root)
    try:
        held = f"/proc/{os.getpid()}/fd/{fd}"
        if not os.path.isdir(f"{held}/."):
            raise UnsafePath(f"{root} cannot be held open here (no /proc/<pid>/fd): not used")
        problem = folder_problem(os.fstat(fd), str(root), group=gid) or tree_problem(f"{held}/.", group=gid)
        if problem is not None:
            raise UnsafePath(problem.replace(f"{held}/.", str(root)))
        folder, shown = Path(held) / "inductor", root / "inductor"
        try:
            folder.mkdir(mode=mode & 0o770, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-") as probe:
                probe.write(b"\0" * 4096)
                probe.flush()
                os.fsync(probe.fileno())
        except OSError as exc:
            raise UnsafePath(f"{shown} cannot be written: {_cause(exc)}") from exc
    except BaseException:
        os.close(fd)
        raise
    return HeldFolder(fd, folder, shown)


def _cause(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or str(exc)


@dataclass
class CompileCache:
    """Where this run's compiles read and write (`folder`), and how many of them the cache answered."""

    folder: Path
    enabled: bool  # the shared cache is in use (not off, not refused)
    refused: str | None = None  # why the cache was not used (the run compiled in its scratch folder)
    _start: tuple[int, int] = (0, 0)
    shown: Path | None = None  # the folder's name for messages (`folder` may be its held path in /proc)

    @classmethod
    @contextmanager
    def open(cls, run_dir: Path, enabled: bool, group: str | None = None) -> Iterator[CompileCache]:
        """Torch's caches pointed at the user's folder (or, off or refused, at a scratch folder of the run)
        for the compiles inside the `with` (inductor reads TORCHINDUCTOR_CACHE_DIR as it compiles; the
        process's own folder, cache switches and umask come back afterwards). A refused cache is one warning line."""
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        refused = None
        folder = shown = run_dir / SCRATCH
        held = None
        if enabled:
            try:
                held = prepare(run_dir, group)
                folder, shown = held.path, held.shown
            except UnsafePath as exc:
                refused = str(exc)
                LOG.warning("compile cache not used: %s; compiling in the run's scratch folder (%s)", refused, SILENCE)
        use_cache = enabled and refused is None
        old_mask = os.umask(0o007 if use_cache and group else 0o077)
        old_folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        old_caches = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
            inductor_config.fx_graph_cache = use_cache
            functorch_config.enable_autograd_cache = use_cache
            yield cls(folder, use_cache, refused, _tally(), shown)
        finally:
            if held is not None:
                os.close(held.fd)
            # The process's own cache settings too: left off, every later compile of the process (a test
            # process's, a bench's) would compile cold (1 min → 2 min for a full-depth twin).
            inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = old_caches
            os.umask(old_mask)
            if old_folder is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old_folder

    def outcome(self) -> str:
        """What the cache did for the compiles since `open`: `hit` (it answered every graph), `miss` (none),
        `partial` (some: a new method, budget or shape compiled beside cached ones), `refused` (not used:
        see `refused`), or `off`."""
        if not self.enabled:
            return "refused" if self.refused else "off"
        hits, misses = (now - then for now, then in zip(_tally(), self._start, strict=True))
        if hits and not misses:
            return "hit"
        return "partial" if hits else "miss"

    def space_problem(self, error: str) -> str | None:
        """Why a compile that failed with `error` failed for lack of space, if it did: the error says so,
        or the folder's file system is (nearly) full."""
        try:
            free_mb = shutil.disk_usage(self.folder).free / 2**20
        except OSError:
            free_mb = None
        if "No space left" in error or "ENOSPC" in error or (free_mb is not None and free_mb < LOW_SPACE_MB):
            where = f" ({free_mb:.0f} MB free)" if free_mb is not None else ""
            return f"no space left for the compile in {self.shown or self.folder}{where}"
        return None
