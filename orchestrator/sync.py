"""Ship the worker's code to a host as an immutable snapshot: WORKDIR/code/<content hash>/.

The snapshot's name is a hash of every file it holds, so an unchanged tree is found on the host and nothing
is copied, and a snapshot a running job imports from is never written again: a changed tree is a new folder.
A new snapshot is built in a temporary folder that is renamed into place only when complete: with rsync
when both ends have it, hard-linking every unchanged file from the newest snapshot (`--link-dest`), so a
one-file change sends one file; otherwise as one gzipped tar over the SSH connection.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from orchestrator import PROJECT_ROOT
from orchestrator.ssh_transport import SSHTransport
from orchestrator.transport import command_result

PACKAGES = ("remote_worker",)
COMPLETE_MARK = ".complete"
SYNC_METHODS = ("auto", "rsync", "tar")


class SyncFailed(RuntimeError):
    pass


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
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


# Fixed scripts, values as positional arguments. Each SSH command costs a round trip and a session, so a sync
# is one command to look (is the snapshot there? rsync? the newest snapshot?), the copy, and one to publish.
_LOOK = (
    f'if [ -f "$1/$2/{COMPLETE_MARK}" ]; then echo present; exit 0; fi; '
    'mkdir -p "$1" && chmod 700 "$1" || exit 1; echo "pid $$"; '
    "command -v rsync >/dev/null 2>&1 && echo rsync; "
    f'newest=$(ls -1t -- "$1"/*/{COMPLETE_MARK} 2>/dev/null | head -n 1); '
    f'[ -z "$newest" ] || echo "newest ${{newest%/{COMPLETE_MARK}}}"'
)
_UNTAR = 'mkdir -p "$1" && tar -xzf "$2" -C "$1"; status=$?; rm -f "$2"; exit $status'
# Another orchestrator may have published the same snapshot meanwhile: then keep theirs.
_PUBLISH = f'touch "$1/{COMPLETE_MARK}" && {{ mv -T "$1" "$2" 2>/dev/null || rm -rf "$1"; }}'


def _rsync(transport: SSHTransport, files: list[Path], root: Path, partial: str, previous: str | None) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".files") as listing:
        listing.write("".join(f"{path.relative_to(root).as_posix()}\n" for path in files))
        listing.flush()
        argv = [
            "rsync",
            "-s",  # arguments reach the remote rsync verbatim, never through its shell (--protect-args)
            "--archive",
            "--checksum",
            f"--files-from={listing.name}",
            *([f"--link-dest={previous}"] if previous else []),
            "--rsh",
            shlex.join(transport.openssh_command()),
            f"{root}/",
            f"{transport.host['hostname']}:{partial}/",
        ]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    command_result(argv, done.returncode, done.stdout, done.stderr, check=True)


def sync_code(
    transport: SSHTransport, workdir: str, root: Path = PROJECT_ROOT, method: str = "auto"
) -> tuple[str, bool]:
    """Make sure the snapshot exists on the host; return (its folder, whether anything was copied).

    `method` is one of SYNC_METHODS: `auto` takes rsync when both ends have it, else tar.
    """
    files = worker_files(root)
    name = content_hash(files, root)
    code_root = posixpath.join(workdir, "code")
    snapshot = posixpath.join(code_root, name)
    look = dict(
        line.partition(" ")[::2]
        for line in transport.run(["sh", "-c", _LOOK, "look", code_root, name]).stdout.splitlines()
    )
    if "present" in look:
        return snapshot, False
    here = shutil.which("rsync") is not None and shutil.which("ssh") is not None
    use_rsync = method != "tar" and here and "rsync" in look
    if method == "rsync" and not use_rsync:
        raise SyncFailed(f"host.sync=rsync, but rsync is missing {'there' if here else 'here'} ({transport.name})")
    partial = f"{snapshot}.part-{look['pid']}"
    if use_rsync:
        _rsync(transport, files, root, partial, look.get("newest"))
    else:
        archive = f"{partial}.tar.gz"
        transport.write_file(archive, _tarball(files, root), 0o600)
        transport.run(["sh", "-c", _UNTAR, "untar", partial, archive])
    transport.run(["sh", "-c", _PUBLISH, "publish", partial, snapshot])
    return snapshot, True
