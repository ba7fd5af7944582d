"""One schema for a host's connection and location values, wherever they come from.

A value typed on the command line, written in a host file, or read back from a run's MLflow tag passes the
same check here: a port is a number from 1 to 65535, a host name is an address or an alias (no user, no
space, no newline, nothing an SSH option or a known_hosts pattern could read), a work folder is an absolute
path with no `..`. A tag is text anyone with access to the tracking server may have written, so the parsers
for tags (`parse_*`) take strings and refuse what the command line's YAML types would have refused.

Every check raises `ValueError` with the reason; the caller names the key or the tag.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

# An address or a ~/.ssh/config alias: letters, digits, dots, dashes, underscores (a name or an IPv4
# address), or an IPv6 address in its own characters. No `@` (a user is host.user), no space, no control
# character, no leading dash (an option to ssh), no `*`, `?`, `!` or `,` (patterns in known_hosts).
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})|[0-9A-Fa-f:.]{2,45}|\[[0-9A-Fa-f:.]{2,45}\]")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_PATH = 4096
MAX_INT = 2**53  # the largest integer a tag's number is allowed: every byte offset and seq fits


def hostname(value: Any) -> str:
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is None or not _HOSTNAME.fullmatch(text):
        raise ValueError("must be an address or a ~/.ssh/config alias (letters, digits, . - _; no user, space or @)")
    return text


def port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError("must be a port number (1-65535)")
    return value


def user(value: Any) -> str:
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise ValueError("must be a user name (letters, digits, . - _)")
    return value


def gateway(value: Any) -> str:
    """A ProxyJump: `[user@]host[:port]`, or several of them separated by commas."""
    if not isinstance(value, str) or not value:
        raise ValueError("must be a gateway host, [user@]host[:port]")
    for hop in value.split(","):
        login, _, address = hop.rpartition("@")
        where, colon, number = address.rpartition(":") if address.count(":") == 1 else (address, "", "")
        try:
            if login:
                user(login)
            hostname(where)
            if colon:
                port(int(number) if number.isdigit() else -1)
        except ValueError as exc:
            raise ValueError(f"must be a gateway host, [user@]host[:port] ({hop[:60]!r} {exc})") from exc
    return value


def folder(value: Any) -> str:
    """An absolute path with no `..` and no control character (a work folder, a run's folder)."""
    if not isinstance(value, str) or not value.startswith("/") or len(value) > MAX_PATH:
        raise ValueError("must be an absolute path")
    if ".." in value.split("/") or _CONTROL.search(value):
        raise ValueError("must be an absolute path without .. or control characters")
    return value


def integer(text: str, minimum: int, maximum: int = MAX_INT) -> int:
    """A tag's whole number within bounds (digits only: no sign but a leading minus, no exponent, no space)."""
    if not isinstance(text, str) or not re.fullmatch(r"-?[0-9]{1,16}", text):
        raise ValueError("is not a whole number")
    number = int(text)
    if not minimum <= number <= maximum:
        raise ValueError(f"is outside {minimum}..{maximum}")
    return number


def parse_port(text: str) -> int:
    return port(integer(text, 1, 65535))


def run_dir_for(workdir: str, run_id: str) -> str:
    """A run's folder: always `runs/<run id>` of the work folder (whatever a tag or a file says)."""
    return posixpath.join(workdir, "runs", run_id)


# The connection settings a run records (tag → the command line's key, its check on a tag's text).
CONNECTION = {
    "host.hostname": hostname,
    "host.port": parse_port,
    "host.user": user,
    "host.proxy_jump": gateway,
}
