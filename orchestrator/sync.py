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


def _newest_snapshot(transport: SSHTransport, code_root: str) -> str | None:
    listing = transport.run(
        ["sh", "-c", 'ls -1t -- "$1"/*/' + COMPLETE_MARK + " 2>/dev/null | head -n 1", "sh", code_root], check=False
    )
    mark = listing.stdout.strip()
    return posixpath.dirname(mark) if mark else None


def _has_rsync(transport: SSHTransport) -> bool:
    here = shutil.which("rsync") is not None and shutil.which("ssh") is not None
    return here and transport.run(["sh", "-c", "command -v rsync"], check=False).ok


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
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise SyncFailed(f"rsync to {transport.name} exited {done.returncode}: {detail[-1] if detail else ''}")


def _untar(transport: SSHTransport, files: list[Path], root: Path, partial: str) -> None:
    archive = f"{partial}.tar.gz"
    transport.write_file(archive, _tarball(files, root), 0o600)
    transport.run(["mkdir", "-p", partial])
    transport.run(["tar", "-xzf", archive, "-C", partial])
    transport.run(["rm", "-f", archive])


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
    if transport.run(["test", "-f", posixpath.join(snapshot, COMPLETE_MARK)], check=False).ok:
        return snapshot, False
    transport.make_dirs(code_root, 0o700)
    use_rsync = method != "tar" and _has_rsync(transport)
    if method == "rsync" and not use_rsync:
        raise SyncFailed(f"host.sync=rsync, but rsync (or ssh) is missing here or on {transport.name}")
    partial = f"{snapshot}.part-{transport.run(['sh', '-c', 'echo $$']).stdout.strip()}"
    if use_rsync:
        _rsync(transport, files, root, partial, _newest_snapshot(transport, code_root))
    else:
        _untar(transport, files, root, partial)
    transport.run(["touch", posixpath.join(partial, COMPLETE_MARK)])
    # Another orchestrator may have published the same snapshot meanwhile: then keep theirs.
    if not transport.run(["mv", "-T", partial, snapshot], check=False).ok:
        transport.run(["rm", "-rf", partial])
    return snapshot, True
