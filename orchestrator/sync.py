"""Ship the worker's code to a host as an immutable snapshot: WORKDIR/code/<content hash>/.

The snapshot's name is a hash of every file it holds, so an unchanged tree is found on the host and nothing
is copied, and a snapshot a running job imports from is never written again: a changed tree is a new folder.
Files go as one gzipped tar over the SSH connection, unpacked into a temporary folder that is renamed into
place only when complete.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
import tarfile
from pathlib import Path

from orchestrator import PROJECT_ROOT
from orchestrator.transport import Transport

PACKAGES = ("remote_worker",)
COMPLETE_MARK = ".complete"


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


def sync_code(transport: Transport, workdir: str, root: Path = PROJECT_ROOT) -> tuple[str, bool]:
    """Make sure the snapshot exists on the host; return (its folder, whether anything was copied)."""
    files = worker_files(root)
    name = content_hash(files, root)
    code_root = posixpath.join(workdir, "code")
    snapshot = posixpath.join(code_root, name)
    if transport.run(["test", "-f", posixpath.join(snapshot, COMPLETE_MARK)], check=False).ok:
        return snapshot, False
    transport.make_dirs(code_root, 0o700)
    partial = f"{snapshot}.part-{transport.run(['sh', '-c', 'echo $$']).stdout.strip()}"
    archive = f"{partial}.tar.gz"
    transport.write_file(archive, _tarball(files, root), 0o600)
    transport.run(["mkdir", "-p", partial])
    transport.run(["tar", "-xzf", archive, "-C", partial])
    transport.run(["touch", posixpath.join(partial, COMPLETE_MARK)])
    transport.run(["rm", "-f", archive])
    # Another orchestrator may have published the same snapshot meanwhile: then keep theirs.
    if not transport.run(["mv", "-T", partial, snapshot], check=False).ok:
        transport.run(["rm", "-rf", partial])
    return snapshot, True
