"""Files one process writes and another reads: they appear whole or not at all.

A reader polling a file that its writer creates and then fills can see it empty or half written (a sweep's
cancel mark read as a cancel with no reason, a job's record read as bad JSON). Every such file is written
here: into a temporary file of the same folder, then renamed onto its name (`os.replace`, atomic within one
file system, shared storage included). A reader takes a missing file as "not yet", never as an error.

The shell scripts run on a host do the same with `sh_write_whole` (a `.part.$$` file, then `mv -fT`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _scratch(path: Path, text: str, mode: int) -> str:
    """`text` in a new file of `path`'s folder (a name no reader looks for), with `mode`; its path."""
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(scratch, mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise
    return scratch


def write_whole(path: Path, text: str, mode: int = 0o644) -> None:
    """Put `text` at `path` in one step: a reader sees the old content, none, or all of the new."""
    scratch = _scratch(path, text, mode)
    try:
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise


def write_first(path: Path, text: str, mode: int = 0o644) -> bool:
    """Put `text` at `path` unless something is there already (the first writer wins); True when this call
    wrote it. Whole as `write_whole`: the text goes to a file of its own, then is linked to `path` (`link`
    fails where the name exists, which `rename` would replace)."""
    scratch = _scratch(path, text, mode)
    try:
        os.link(scratch, path)
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(scratch)


def read_whole(path: Path) -> str | None:
    """The file's text, or None when it is not there (yet, or any more)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def sh_write_whole(value: str, name: str, scratch: str = "") -> str:
    """A shell command that puts `value` (shell words, expanded) into the file `name` whole: written to
    `scratch` (by default `name.part.<pid>`; give one that the folder's readers' globs do not match) first,
    then renamed. `name` and `scratch` are fixed names of ours or quoted expansions, in one folder.

    The scratch file is created exclusively and without following a link (`dd conv=excl oflag=nofollow`),
    and `mv -T` replaces whatever entry `name` is (a link included) instead of writing into a folder it names:
    no planted link turns the write into one elsewhere (`remote_worker/safe_files.py`'s rules, in shell)."""
    scratch = scratch or f"{name}.part.$$"
    return (
        f"{{ rm -f {scratch}; echo {value} | dd of={scratch} conv=excl oflag=nofollow status=none && "
        f"mv -fT {scratch} {name}; }}"
    )


def sh_read(name: str) -> str:
    """A shell command that prints the regular file `name` (a fixed name of ours or a quoted expansion) without
    following a link, nothing when it is missing or not one."""
    return f"dd if={name} iflag=nofollow,nonblock status=none 2>/dev/null"
