"""The safe file layer: every file the tool reads or writes in a run, work or state folder goes through here.

A host's work folder is often shared by a group, and a run folder may hold a link someone planted (or a
tag may point the tool at a folder someone crafted). Then a plain `open` would turn our write of a marker
into a write over `~/.ssh/authorized_keys`, and our read of a log into an upload of a secret. So, below a
root the user chose (the work folder, the state folder), this module:

- opens every component without following a symbolic link: one directory at a time, each `O_NOFOLLOW`
  relative to its parent's descriptor, so no component can be swapped for a link between a check and use;
- creates exclusively (`O_EXCL`) what should not exist yet; a whole-file write goes to a new scratch file
  that is renamed onto the name, so a link standing there is replaced, never followed;
- refuses anything that is not a regular file (a FIFO would hang a read, a device would feed it garbage).

A refusal is `UnsafePath`, whose message is one line naming the path and what was wrong with
it. The root itself is followed as given (it is the user's own setting, and may legitimately sit behind a
link such as /tmp → /private/tmp); `private_folder` checks a root that must be the user's alone.

Standard library only: the worker uses it on its side (`remote_worker` runs in the host's own Python), the
orchestrator on this machine (its state folder, and the run folders of `host=local`). An SSH host's files
go through the same rules in `orchestrator/host/ssh_files.py`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
CHUNK = 1 << 20


class UnsafePath(Exception):
    """A path the layer refuses to use (a link, not a regular file, outside its folder, not the user's own):
    the message is the one line shown to the user. Not an OSError: callers that retry an OSError as a lost
    connection must not retry this; it is a refusal, and waiting does not change it."""


def parts_of(relative: str) -> list[str]:
    """The components of a path relative to a folder; refused when it could leave the folder."""
    text = str(relative)
    if not text or text.startswith("/") or "\0" in text:
        raise UnsafePath(f"{text[:80]!r} is not a path inside the folder")
    parts = [part for part in text.split("/") if part not in ("", ".")]
    if not parts or any(part == ".." for part in parts):
        raise UnsafePath(f"{text[:80]!r} is not a path inside the folder")
    return parts


def _refusal(path: str, error: OSError) -> Exception:
    """What `O_NOFOLLOW` and `O_DIRECTORY` failures mean here: a link (ELOOP), or not a folder (ENOTDIR)."""
    import errno

    if error.errno == errno.ELOOP:
        return UnsafePath(f"{path} is a symbolic link; not followed")
    if error.errno == errno.ENOTDIR:
        return UnsafePath(f"{path} is not a folder (or a folder on its way is a link); not used")
    return error


class Folder:
    """A folder the user chose (`root`), and the files below it, reached without following any link.

    `root` is used as given; every path handed to a method is relative to it (`runs/<id>/events.jsonl`)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"Folder({self.root!r})"

    def _name(self, parts: list[str]) -> str:
        return os.path.join(self.root, *parts)

    @contextlib.contextmanager
    def _parent(self, relative: str, *, create: bool = False, mode: int = 0o700) -> Iterator[tuple[int, str]]:
        """The descriptor of the folder holding `relative`'s last component, and that component's name.

        With `create`, missing folders on the way are made (with `mode`); else a missing one raises
        FileNotFoundError."""
        parts = parts_of(relative)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for index, part in enumerate(parts[:-1]):
                try:
                    child = os.open(part, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, mode, dir_fd=fd)
                    try:
                        child = os.open(part, _DIR, dir_fd=fd)
                    except OSError as error:
                        raise _refusal(self._name(parts[: index + 1]), error) from error
                except OSError as error:
                    raise _refusal(self._name(parts[: index + 1]), error) from error
                os.close(fd)
                fd = child
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _open_regular(self, relative: str) -> int | None:
        """A read descriptor of the regular file `relative`; None when it does not exist."""
        try:
            with self._parent(relative) as (parent, name):
                try:
                    fd = os.open(name, _READ, dir_fd=parent)
                except FileNotFoundError:
                    return None
                except OSError as error:
                    raise _refusal(self._name(parts_of(relative)), error) from error
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePath(f"{self._name(parts_of(relative))} is not a regular file; not read")
        return fd

    # -- reading ---------------------------------------------------------------------------------------------

    def read(self, relative: str, offset: int = 0, limit: int | None = None) -> bytes | None:
        """Up to `limit` bytes (all, when None) of `relative` from `offset`; None when there is no such file."""
        fd = self._open_regular(relative)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            f.seek(max(0, offset))
            return f.read() if limit is None else f.read(limit)

    def read_text(self, relative: str) -> str | None:
        data = self.read(relative)
        return None if data is None else data.decode("utf-8", errors="replace")

    def size(self, relative: str) -> int | None:
        fd = self._open_regular(relative)
        if fd is None:
            return None
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def copy_to(self, relative: str, local: str | os.PathLike[str], limit: int | None = None) -> bool:
        """Copy the regular file `relative` to `local` (a path of the caller's own); False when it is missing.
        `limit`: refuse a file larger than that many bytes."""
        fd = self._open_regular(relative)
        if fd is None:
            return False
        with os.fdopen(fd, "rb") as source:
            size = os.fstat(source.fileno()).st_size
            if limit is not None and size > limit:
                raise UnsafePath(f"{self._name(parts_of(relative))} is {size} bytes, more than {limit}; not copied")
            with open(local, "wb") as target:
                while chunk := source.read(CHUNK):
                    target.write(chunk)
        return True

    def is_folder(self, relative: str) -> bool:
        """Whether `relative` is a folder reached without a link (a link there is refused)."""
        try:
            with self._parent(relative) as (parent, name):
                try:
                    os.close(os.open(name, _DIR, dir_fd=parent))
                except FileNotFoundError:
                    return False
                except OSError as error:
                    raise _refusal(self._name(parts_of(relative)), error) from error
        except FileNotFoundError:
            return False
        return True

    def stat(self, relative: str) -> os.stat_result | None:
        """The entry's own status (a link is described, never followed); None when it is missing."""
        try:
            with self._parent(relative) as (parent, name):
                return os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None

    # -- writing ---------------------------------------------------------------------------------------------

    def make_dirs(self, relative: str, mode: int = 0o700) -> None:
        """Create `relative` and the folders on its way (each `mode`; the root too, if missing); refuse a link
        or a file on the way."""
        os.makedirs(self.root, mode, exist_ok=True)
        with self._parent(relative, create=True, mode=mode) as (parent, name):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=parent)
            try:
                fd = os.open(name, _DIR, dir_fd=parent)
            except OSError as error:
                raise _refusal(self._name(parts_of(relative)), error) from error
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def create(self, relative: str, data: bytes, mode: int = 0o600) -> bool:
        """Create `relative` holding `data`, only if no entry of that name exists (a link counts as one);
        True when this call created it. The bytes are in place before the name appears (the first writer's
        whole text wins)."""
        with self._parent(relative) as (parent, name):
            scratch = self._scratch(parent, name, data, mode)
            try:
                os.link(scratch, name, src_dir_fd=parent, dst_dir_fd=parent, follow_symlinks=False)
                return True
            except FileExistsError:
                return False
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(scratch, dir_fd=parent)

    def open_new(self, relative: str, mode: int = 0o600) -> int:
        """A write descriptor of a new, empty regular file `relative`: whatever stood at the name (an earlier
        attempt's file, a link) is removed first, never written through."""
        with self._parent(relative) as (parent, name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent)
            try:
                return os.open(name, _NEW, mode, dir_fd=parent)
            except OSError as error:
                raise _refusal(self._name(parts_of(relative)), error) from error

    def write_new(self, relative: str, data: bytes, mode: int = 0o600) -> None:
        """Create `relative` with `data` in place, exclusively (FileExistsError where any entry of that name
        exists, a link included): for a file of one's own that nobody reads while it is written."""
        with self._parent(relative) as (parent, name):
            try:
                fd = os.open(name, _NEW, mode, dir_fd=parent)
            except FileExistsError:
                raise
            except OSError as error:
                raise _refusal(self._name(parts_of(relative)), error) from error
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), mode)

    def write_whole(self, relative: str, data: bytes, mode: int = 0o600) -> None:
        """Put `data` at `relative` in one step: a reader sees the old content, none, or all of the new. A link
        standing at the name is replaced by the file, never written through; a folder there is refused."""
        with self._parent(relative) as (parent, name):
            scratch = self._scratch(parent, name, data, mode)
            try:
                os.replace(scratch, name, src_dir_fd=parent, dst_dir_fd=parent)
            except IsADirectoryError as error:
                raise UnsafePath(f"{self._name(parts_of(relative))} is a folder; not written") from error
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(scratch, dir_fd=parent)

    def _scratch(self, parent: int, name: str, data: bytes, mode: int) -> str:
        """A new file beside `name`, holding `data` with `mode` (created exclusively: a random name no
        reader looks for)."""
        scratch = f".{name}.{secrets.token_hex(6)}.part"
        fd = os.open(scratch, _NEW, mode, dir_fd=parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), mode)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(scratch, dir_fd=parent)
            raise
        return scratch

    def open_append(self, relative: str, mode: int = 0o600) -> int:
        """A descriptor appending to the regular file `relative` (created if missing), never through a link."""
        with self._parent(relative) as (parent, name):
            try:
                fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                             dir_fd=parent)  # fmt: skip
            except OSError as error:
                raise _refusal(self._name(parts_of(relative)), error) from error
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePath(f"{self._name(parts_of(relative))} is not a regular file; not written")
        return fd

    def open_update(self, relative: str, mode: int = 0o600) -> int:
        """A read-write descriptor of the regular file `relative` (created if missing), never through a link."""
        with self._parent(relative) as (parent, name):
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode,
                             dir_fd=parent)  # fmt: skip
            except OSError as error:
                raise _refusal(self._name(parts_of(relative)), error) from error
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePath(f"{self._name(parts_of(relative))} is not a regular file; not used")
        return fd

    def remove(self, relative: str) -> bool:
        """Remove the entry `relative` (a link is removed itself, never its target); False when missing."""
        try:
            with self._parent(relative) as (parent, name):
                os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            return False
        return True


# -- folders that must be the user's alone ----------------------------------------------------------------------


def folder_problem(info: os.stat_result, path: str, *, group: int | None = None) -> str | None:
    """Why a folder (or file) may not be trusted to hold what only its owner should write; None when it may.

    Its owner must be this user; no one else may write it: no write bit for others, and none for the group
    unless `group` names the group the user chose to share with (then it must be that group's)."""
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if info.st_uid != os.geteuid() and group is None:
        return f"{path} is owned by uid {info.st_uid}, not by you (uid {os.geteuid()})"
    if info.st_mode & stat.S_IWOTH:
        return f"{path} is writable by every user (mode {stat.S_IMODE(info.st_mode):04o})"
    if info.st_mode & stat.S_IWGRP and (group is None or info.st_gid != group):
        return f"{path} is writable by its group (mode {stat.S_IMODE(info.st_mode):04o})"
    if group is not None and info.st_gid != group:
        return f"{path} belongs to group {info.st_gid}, not the shared group {group}"
    return None


def private_folder(path: str | os.PathLike[str], mode: int = 0o700) -> Path:
    """`path` as a folder only this user can write: created with `mode` if missing (its parents too), else
    checked. Raises UnsafePath naming what is wrong: a link, another owner, a group or other write bit."""
    folder = Path(path)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=mode, parents=True)
    info = os.lstat(folder)
    problem = folder_problem(info, str(folder))
    if problem is None and not stat.S_ISDIR(info.st_mode):
        problem = f"{folder} is not a folder"
    if problem is not None:
        raise UnsafePath(problem)
    return folder


def tree_problem(root: str | os.PathLike[str], *, group: int | None = None, limit: int = 200_000) -> str | None:
    """The first entry of the tree under `root` (itself included) that another user could have written, or a
    link; None when every entry is this user's own (or, with `group`, that group's and not other-writable)."""
    seen = 0
    for directory, folders, files in os.walk(root, followlinks=False):
        for name in [".", *folders, *files]:
            path = os.path.join(directory, name) if name != "." else directory
            problem = folder_problem(os.lstat(path), path, group=group)
            if problem is not None:
                return problem
            seen += 1
            if seen > limit:
                return f"{root} holds more than {limit} entries; not checked whole"
    return None
