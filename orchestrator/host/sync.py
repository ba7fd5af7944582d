"""Ship the worker's code to a host as an immutable snapshot: WORKDIR/code/<content hash>/.

The snapshot's name is a hash of every file it holds, so an unchanged tree is found on the host and nothing
is copied, and a snapshot a running job imports from is never written again: a changed tree is a new folder.
A new snapshot is built in a temporary folder that is renamed into place only when complete: with rsync
when both ends have it, hard-linking every unchanged file from the newest snapshot (`--link-dest`), so a
one-file change sends one file; otherwise as one gzipped tar over the SSH connection.

Partial copies (`<hash>.part-<n>` folders, `<hash>.part-<n>.tar.gz` archives) never outlive their sync for
long. A sync that fails or is interrupted (Ctrl-C included) removes its own, best effort and for a few
seconds at most, so a dead link never holds up the exit: over the connection while it is up, else (an
interrupted SFTP write drops the connection rather than wait on it) with one OpenSSH command killed at the
time limit. What that misses (an orchestrator killed outright, a cut link, no local `ssh`) the next sync's
first command removes: any part in which nothing has changed for STALE_PART_MIN minutes (by ctime, which
copying always updates and nothing can set back; tar and rsync set mtimes into the past). A part's name
cannot say whether its copy is still alive: `<n>` is the pid of the short-lived shell that looked, gone
before the copy starts, and no process on the host lives exactly as long as an SFTP or rsync copy; so age
decides, and a copy still making progress always has something recent inside.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import posixpath
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Protocol

from orchestrator.config.paths import PROJECT_ROOT
from orchestrator.config.settings import HostConfig
from orchestrator.host.preflight import workdir_problem
from orchestrator.host.transport import CommandFailed, Transport, command_result

PACKAGES = ("remote_worker",)
COMPLETE_MARK = ".complete"
STALE_PART_MIN = 10  # minutes without change after which a partial copy counts as abandoned
CLEANUP_TIMEOUT_S = 5.0  # the longest a failed or interrupted sync spends removing its partial copy


class RemoteHost(Transport, Protocol):
    """What a sync needs beyond the Transport interface: the OpenSSH client's view of the same host (for rsync
    and for a clean-up without the connection), and whether the connection is up. `ssh.SSHTransport` is one."""

    host: HostConfig

    @property
    def hostname(self) -> str: ...

    @property
    def connected(self) -> bool: ...

    def openssh_command(self) -> list[str]: ...


class SyncFailed(RuntimeError):
    """The code could not be copied; the message names the setting or resource (not the host: callers add it)."""


def worker_files(root: Path = PROJECT_ROOT) -> list[Path]:
    """What the worker needs: its package, without caches or compiled files."""
    files = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                files.append(path)
    return files


def content_hash(files: list[Path], root: Path = PROJECT_ROOT) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _tarball(files: list[Path], root: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in files:
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode &= ~0o022  # writable by its owner alone on the host, whatever this checkout's umask was
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


# Fixed scripts, values as positional arguments. Each SSH command costs a round trip and a session, so a sync
# is one command to look (is the snapshot there? rsync? the newest snapshot?), the copy, and one to publish.
# Looking first removes parts in which nothing changed for $3 (STALE_PART_MIN) minutes: left by a sync that
# died. A part whose age `find` cannot tell (an error, no -cmin) is kept.
_SWEEP = (
    'for part in "$1"/*.part-*; do [ -e "$part" ] || continue; '
    'recent=$(find "$part" -cmin "-$3" 2>/dev/null) || continue; '
    '[ -n "$recent" ] || rm -rf -- "$part"; done; '
)


# What runs as the worker is imported from here: a code folder or snapshot that is a link, not this user's, or
# writable by anyone else may hold code someone planted (a snapshot named with our hash, or files a
# `--link-dest` would hard-link into ours). `sh_first_foreign(folder)` prints the first such entry under the
# folder (itself included); the worker's supervisor runs the same check on the snapshot it holds (`launch.py`).
def sh_first_foreign(folder: str) -> str:
    """A shell command printing the first entry under `folder` (a shell word: quoted, or a fixed path) that is a
    link, not this user's, or writable by its group or others; nothing when there is none."""
    return f'find {folder} \\( -type l -o ! -user "$(id -u)" -o -perm /022 \\) -print 2>/dev/null | head -n 1'


_FOREIGN = sh_first_foreign('"$1"')
_LOOK = (
    'if [ -L "$1" ]; then echo "unsafe $1"; exit 0; fi; [ -d "$1" ] || mkdir -p "$1" || exit 1; '
    'bad=$(find "$1" -maxdepth 0 ! -user "$(id -u)" -print); [ -z "$bad" ] || { echo "unsafe $bad"; exit 0; }; '
    'chmod 700 "$1" || exit 1; ' + _SWEEP + f'if [ -f "$1/$2/{COMPLETE_MARK}" ]; then '
    f'bad=$(set -- "$1/$2"; {_FOREIGN}); [ -z "$bad" ] && echo present || echo "unsafe $bad"; exit 0; fi; '
    'echo "pid $$"; command -v rsync >/dev/null 2>&1 && echo rsync; '
    f'newest=$(ls -1t -- "$1"/*/{COMPLETE_MARK} 2>/dev/null | head -n 1); newest=${{newest%/{COMPLETE_MARK}}}; '
    f'[ -n "$newest" ] && [ -z "$(set -- "$newest"; {_FOREIGN})" ] && echo "newest $newest"; exit 0'
)
_UNTAR = 'umask 022; mkdir -p "$1" && tar --no-same-owner -xzf "$2" -C "$1"; status=$?; rm -f "$2"; exit $status'
# Another orchestrator may have published the same snapshot meanwhile: then keep theirs.
_PUBLISH = f'touch "$1/{COMPLETE_MARK}" && {{ mv -T "$1" "$2" 2>/dev/null || rm -rf "$1"; }}'


def _rsync(transport: RemoteHost, files: list[Path], root: Path, partial: str, previous: str | None) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".files") as listing:
        listing.write("".join(f"{path.relative_to(root).as_posix()}\n" for path in files))
        listing.flush()
        argv = [
            "rsync",
            "-s",  # arguments reach the remote rsync verbatim, never through its shell (--protect-args)
            "--archive",
            "--chmod=go-w",  # writable by its owner alone on the host (`_LOOK` refuses anything else)
            "--checksum",
            f"--files-from={listing.name}",
            *([f"--link-dest={previous}"] if previous else []),
            "--rsh",
            shlex.join(transport.openssh_command()),
            f"{root}/",
            f"{transport.hostname}:{partial}/",
        ]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    command_result(argv, done.returncode, done.stdout, done.stderr, check=True)


def sync_code(
    transport: RemoteHost, workdir: str, root: Path = PROJECT_ROOT, method: str = "auto", owner: str = ""
) -> tuple[str, bool]:
    """Make sure the snapshot exists on the host; return (its folder, whether anything was copied).

    `method` is one of `config.settings.SYNC_METHODS`: `auto` takes rsync when both ends have it, else tar.
    `owner` (the run's id) names the partial copy, so that `remove_abandoned_parts` can find the one a run's
    orchestrator left when it was killed mid-copy, at once rather than STALE_PART_MIN later.
    """
    if owner and not _OWNER.fullmatch(owner):
        raise ValueError(f"not a run id: {owner!r}")
    files = worker_files(root)
    name = content_hash(files, root)
    code_root = posixpath.join(workdir, "code")
    snapshot = posixpath.join(code_root, name)
    try:
        looked = transport.run(["sh", "-c", _LOOK, "look", code_root, name, str(STALE_PART_MIN)])
    except CommandFailed as error:  # the code folder cannot be made: say why in the host's settings
        raise _sync_failure(transport, workdir, error) from error
    look = dict(line.partition(" ")[::2] for line in looked.stdout.splitlines())
    if "unsafe" in look:  # never imported from: refused in one line, nothing copied or started
        raise SyncFailed(
            f"host.workdir {workdir}: {look['unsafe']} is a link, not yours, or writable by others: the worker's code "
            "is never run from there (remove it, or choose another host.workdir)"
        )
    if "present" in look:
        return snapshot, False
    here = shutil.which("rsync") is not None and shutil.which("ssh") is not None
    use_rsync = method != "tar" and here and "rsync" in look
    if method == "rsync" and not use_rsync:
        raise SyncFailed(f"host.sync=rsync, but rsync is missing {'there' if here else 'here'} ({transport.name})")
    partial = f"{snapshot}.part-{owner or look['pid']}"
    archive = f"{partial}.tar.gz"
    data = None if use_rsync else _tarball(files, root)
    try:
        if data is None:
            _rsync(transport, files, root, partial, look.get("newest"))
        else:
            transport.write_file(archive, data, 0o600, exclusive=True)
            transport.run(["sh", "-c", _UNTAR, "untar", partial, archive])
        transport.run(["sh", "-c", _PUBLISH, "publish", partial, snapshot])
    except BaseException as error:
        # Named before the part is removed: removing it may free the space whose lack made the copy fail.
        failure = (
            _sync_failure(transport, workdir, error) if isinstance(error, Exception) and transport.connected else None
        )
        _remove_parts(transport, [partial, archive])
        if failure is not None:
            raise failure from error
        raise
    return snapshot, True


_OWNER = re.compile(r"[0-9A-Za-z_-]{1,64}")
# The partial copies named for one run ($2) under the code folder ($1); says `removed` when there were some.
_REMOVE_OWNED = (
    'found=; for part in "$1"/*.part-"$2" "$1"/*.part-"$2".tar.gz; do [ -e "$part" ] || continue; '
    'rm -rf -- "$part"; found=1; done; [ -z "$found" ] || echo removed'
)


def remove_abandoned_parts(transport: Transport, workdir: str, owner: str) -> bool:
    """Remove the partial copy a run's sync left (its orchestrator was killed mid-copy); True if there was one."""
    if not _OWNER.fullmatch(owner):
        raise ValueError(f"not a run id: {owner!r}")
    code_root = posixpath.join(workdir, "code")
    return transport.run(["sh", "-c", _REMOVE_OWNED, "remove-parts", code_root, owner]).stdout.strip() == "removed"


def _remove_parts(transport: RemoteHost, paths: list[str]) -> None:
    """Remove a failed sync's partial copy, best effort: never raises, never waits past CLEANUP_TIMEOUT_S.

    Over the live connection, in a daemon thread, so a link that dies meanwhile cannot hold the caller.
    Without one (an interrupted SFTP write drops it) a new connection could take the whole connect timeout,
    so the OpenSSH client does it, killed at the time limit; where there is none, the next sync's sweep does.
    """
    if transport.connected:

        def remove() -> None:
            with contextlib.suppress(Exception):
                transport.run(["rm", "-rf", "--", *paths], check=False)

        worker = threading.Thread(target=remove, name="sync-cleanup", daemon=True)
        worker.start()
        worker.join(CLEANUP_TIMEOUT_S)
    elif shutil.which("ssh") is not None:
        with contextlib.suppress(Exception):
            argv = [*transport.openssh_command(), transport.hostname, shlex.join(["rm", "-rf", "--", *paths])]
            subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=CLEANUP_TIMEOUT_S, check=False)


def _sync_failure(transport: RemoteHost, workdir: str, error: Exception) -> SyncFailed:
    """The failed copy in the words of the host's settings: the work dir's problem when one shows.

    Never raises: a failure to find out gives the copy's own last line of error.
    """
    with contextlib.suppress(Exception):
        problem = workdir_problem(transport, workdir, transport.host.python)
        if problem is not None:
            return SyncFailed(problem)
    if isinstance(error, CommandFailed):
        output = (error.result.stderr or error.result.stdout).strip().splitlines()
        detail = output[-1] if output else f"exit status {error.result.exit_code}"
    else:
        detail = f"{type(error).__name__}: {error}"
    return SyncFailed(f"copying the worker's code to host.workdir {workdir} failed: {detail}")
