"""The safe file layer on an SSH host: the rules of `remote_worker/safe_files.py`, kept over the connection.

SFTP has no way to open a file without following a link, so what is read travels through `dd
iflag=nofollow` on the host (a command's own channel, its output as bytes), after a walk from the work
folder that refuses a link or a non-folder at each component. What is written goes over SFTP to a new
scratch file created exclusively (`O_EXCL`, which never follows a link) in a folder reached by the same
checks, then is renamed onto its name (a link standing there is replaced, not followed) or, for a file that
must not exist yet, hard-linked to it (`ln -T`, which fails where any entry of that name exists).

The host needs GNU coreutils (`dd`'s nofollow, `ln -T`, `mv -T`), as every Linux GPU host has.
"""

from __future__ import annotations

import contextlib
import posixpath
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import paramiko

from orchestrator.host.transport import CommandFailed, CommandResult, inside
from remote_worker.safe_files import UnsafePath, parts_of

MISSING, REFUSED = 3, 4  # the scripts' exit codes: no such file; a link or a non-regular file on the way

# `walk ROOT DIR CREATE MODE`: cd into the folder DIR (a relative path, `/`-separated) below ROOT, one
# component at a time, refusing a link or a non-folder; with CREATE=1, a missing one is made with MODE.
# On a refusal it prints `link|notdir <path so far>` on stderr and returns REFUSED.
WALK = (
    'walk() { cd -- "$1" 2>/dev/null || return 3; sofar=; old=$IFS; IFS=/; set -f; '
    'for part in $2; do IFS=$old; [ -n "$part" ] || continue; sofar="$sofar${sofar:+/}$part"; '
    '[ -L "$part" ] && { echo "link $sofar" >&2; return 4; }; '
    'if [ ! -e "$part" ]; then [ "$3" = 1 ] || return 3; mkdir -m "$4" -- "$part" 2>/dev/null; fi; '
    '[ -L "$part" ] && { echo "link $sofar" >&2; return 4; }; '
    '[ -d "$part" ] || { [ -e "$part" ] || return 3; echo "notdir $sofar" >&2; return 4; }; '
    'cd -- "$part" || return 5; done; IFS=$old; set +f; }; '
)
# `$1` root, `$2` folder, `$3` name: the regular file NAME there, or exit MISSING / REFUSED (with why).
_REGULAR = (
    WALK + 'walk "$1" "$2" 0 0 || exit $?; '
    '[ -L "$3" ] && { echo "link ${2:+$2/}$3" >&2; exit 4; }; [ -e "$3" ] || exit 3; '
    '[ -f "$3" ] || { echo "notregular ${2:+$2/}$3" >&2; exit 4; }; '
)
# ... then `$4` offset, `$5` limit (-1: to the end): its bytes on stdout, opened with O_NOFOLLOW.
READ = (
    _REGULAR + 'if [ "$5" -lt 0 ]; then exec dd if="$3" iflag=nofollow,nonblock,skip_bytes skip="$4" bs=1M '
    "status=none; fi; "
    'exec dd if="$3" iflag=nofollow,nonblock,skip_bytes,count_bytes skip="$4" count="$5" bs=1M status=none'
)
SIZE = _REGULAR + 'exec stat -c %s -- "$3"'
# `$1` root, `$2` folder, `$3` mode: the folder and those on its way made (MODE), then set to MODE.
MAKE_DIRS = WALK + '[ -d "$1" ] || mkdir -p -m 700 -- "$1"; walk "$1" "$2" 1 "$3" || exit $?; chmod "$3" .'
# `$1` root, `$2` folder, `$3` a scratch file there, `$4` its name: `created` if NAME did not exist, else
# `exists`; the scratch file is gone either way.
LINK_NEW = (
    WALK + 'walk "$1" "$2" 0 0 || exit $?; if ln -T -- "$3" "$4" 2>/dev/null; then r=created; else r=exists; fi; '
    'rm -f -- "$3"; echo $r'
)


class RawHost(Protocol):
    """What the layer needs of an SSH transport: a command with its output as bytes, and its SFTP session."""

    name: str

    def exec_bytes(self, argv: list[str], sink: Callable[[bytes], None] | None = None) -> tuple[int, bytes, str]: ...

    def sftp_client(self) -> paramiko.SFTPClient: ...

    def sftp_write(self, path: str, data: bytes, mode: int, flags: str) -> None: ...


def _refused(root: str, result: tuple[int, bytes, str]) -> UnsafePath:
    """The refusal a script's REFUSED exit reported, as one line naming the path."""
    words = result[2].strip().splitlines()[-1].split(" ", 1) if result[2].strip() else ["", "?"]
    why = {"link": "is a symbolic link; not followed", "notdir": "is not a folder; not used",
           "notregular": "is not a regular file; not used"}.get(words[0], "cannot be used safely")  # fmt: skip
    return UnsafePath(f"{posixpath.join(root, words[-1])} {why}")


class SSHFiles:
    """The file operations of `ssh.SSHTransport`, all inside the host's work folder `root`."""

    def __init__(self, host: RawHost, root: str) -> None:
        self.host, self.root = host, root

    def _split(self, path: str) -> tuple[str, str]:
        parts = parts_of(inside(self.root, path))
        return "/".join(parts[:-1]), parts[-1]

    def _script(
        self, script: str, name: str, args: list[str], sink: Callable[[bytes], None] | None = None
    ) -> bytes | None:
        """Run a fixed script; its stdout, or None for MISSING; REFUSED and other failures raise."""
        argv = ["sh", "-c", script, name, self.root, *args]
        result = self.host.exec_bytes(argv, sink)
        code, out, err = result
        if code == MISSING:
            return None
        if code == REFUSED:
            raise _refused(self.root, result)
        if code != 0:
            raise CommandFailed([*argv[:2], name, *args], CommandResult(code, "", err))
        return out

    def read(self, path: str, offset: int, limit: int) -> bytes:
        folder, name = self._split(path)
        return self._script(READ, "safe-read", [folder, name, str(max(0, offset)), str(limit)]) or b""

    def size(self, path: str) -> int | None:
        folder, name = self._split(path)
        out = self._script(SIZE, "safe-size", [folder, name])
        return None if out is None else int(out.decode().strip() or 0)

    def fetch(self, path: str, local: Path) -> bool:
        folder, name = self._split(path)
        with open(local, "wb") as target:
            found = self._script(READ, "safe-read", [folder, name, "0", "-1"], target.write)
        return found is not None

    def make_dirs(self, path: str, mode: int) -> None:
        folder = "/".join(parts_of(inside(self.root, path)))
        if self._script(MAKE_DIRS, "safe-mkdir", [folder, format(mode, "o")]) is None:
            raise FileNotFoundError(f"{path} could not be created (host.workdir {self.root})")

    def _check_folder(self, folder: str) -> None:
        """Every component of `folder` below the root is a folder, not a link (over SFTP: lstat each)."""
        sftp = self.host.sftp_client()
        here = self.root
        for part in [p for p in folder.split("/") if p]:
            here = posixpath.join(here, part)
            try:
                mode = sftp.lstat(here).st_mode or 0
            except FileNotFoundError as missing:
                raise FileNotFoundError(f"{here} does not exist") from missing
            if stat.S_ISLNK(mode):
                raise UnsafePath(f"{here} is a symbolic link; not followed")
            if not stat.S_ISDIR(mode):
                raise UnsafePath(f"{here} is not a folder; not used")

    def _scratch(self, folder: str, name: str, data: bytes, mode: int) -> str:
        self._check_folder(folder)
        scratch = posixpath.join(self.root, folder, f".{name}.{secrets.token_hex(6)}.part")
        self.host.sftp_write(scratch, data, mode, "wbx")  # O_EXCL: a new file, never a link's target
        return scratch

    def write_new(self, path: str, data: bytes, mode: int) -> None:
        folder, name = self._split(path)
        self._check_folder(folder)
        self.host.sftp_write(posixpath.join(self.root, folder, name), data, mode, "wbx")

    def write_whole(self, path: str, data: bytes, mode: int) -> None:
        folder, name = self._split(path)
        scratch = self._scratch(folder, name, data, mode)
        sftp = self.host.sftp_client()
        try:
            sftp.posix_rename(scratch, posixpath.join(self.root, folder, name))
        except OSError as error:
            with contextlib.suppress(OSError):
                sftp.remove(scratch)
            raise UnsafePath(f"{path} could not be replaced ({error}); not written") from error

    def create(self, path: str, data: bytes, mode: int) -> bool:
        folder, name = self._split(path)
        scratch = self._scratch(folder, name, data, mode)
        out = self._script(LINK_NEW, "safe-create", [folder, posixpath.basename(scratch), name])
        return (out or b"").strip() == b"created"
