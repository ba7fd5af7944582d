"""Keep secrets secret: redact secret-looking keys and URL passwords in configs, overrides, logs and files.

A key is secret when it is named like `*_KEY` (its last word is `key`), `*_TOKEN` (the whole word `token`
anywhere), or holds `password`, `secret`, `passwd`, `passphrase` or `credential` anywhere. Its value becomes
`***` wherever it shows: MLflow params and tags, Hydra's command-line overrides, the files Hydra writes into
each output folder, and the log records Hydra prints and writes (`RedactingFilter`).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

REDACTED = "***"
# Anywhere in a key, case-insensitive: `db_password`, `client_secret`, `secretary_count` and `my_credentials`.
SECRET_SUBSTRINGS = ("password", "secret", "passwd", "passphrase", "credential")
# Whole words anywhere in a key.
SECRET_WORDS = frozenset({"apikey"})
# The last word of a key: `HF_TOKEN`, `authToken`, `SSH_KEY`, `AWS_SECRET_ACCESS_KEY`, `apiKey`; not
# `mask_token_id` (a vocabulary id), `max_new_tokens`, `tokenizer`, `linear_key_head_dim`, `keepalive_s`.
SECRET_LAST_WORDS = frozenset({"key", "token"})
# Words of a key: split on anything not a letter or digit, and between camelCase humps (`apiKey` → api, Key).
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_API_KEY = re.compile(r"api[_-]?key", re.IGNORECASE)
# `scheme://user:password@host`: the password runs to the last `@` before the path, as `urlsplit` reads it.
# Hydra escapes a swept job's override values (`https\://alice\:pw@host/`): a `\` may precede either colon.
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*\\?://[^\s/?#@:\\]*\\?:)([^\s/?#]*)@")
# A Hydra override's key at the start of its text: `+host.env.HF_TOKEN=`, `~db@backup.password=`, `seed=`.
_OVERRIDE_KEY = re.compile(r"\s*(~|\+\+|\+)?([A-Za-z_$][\w.@/$-]*)=")
# The same anywhere in free text (a log line, `override_dirname`'s `a=1,+host.env.HF_TOKEN=x`, a URL query).
_TEXT_KEY = re.compile(r"(?<![\w.@/$])(~|\+\+|\+)?([A-Za-z_][\w.@/$-]*)=")
_NEXT_OVERRIDE = re.compile(r"(~|\+\+|\+)?[A-Za-z_][\w.@/$-]*=")
# An entry's key in a dict literal (`{HF_TOKEN: x}`, `{'HF_TOKEN': 'x'}`), from just after its `{` or `,`.
_ENTRY_KEY = re.compile(r"""\s*(?:'([^'\n]*)'|"([^"\n]*)"|([^\s:,{}\[\]()'"]+))\s*:""")
_OPENERS, _CLOSERS = "{[(", "}])"
# A quote opens a quoted string only where a value or an element begins; elsewhere it is an apostrophe.
_QUOTE_MAY_FOLLOW = "=,[{(:"


def _words(key: str) -> list[str]:
    return [word.lower() for word in _WORD.findall(key)]


def is_secret_key(key: str) -> bool:
    lowered = key.lower()
    if any(part in lowered for part in SECRET_SUBSTRINGS) or _API_KEY.search(key):
        return True
    words = _words(key)
    return bool(SECRET_WORDS.intersection(words)) or (bool(words) and words[-1] in SECRET_LAST_WORDS)


def _is_secret_path(key: str) -> bool:
    """A dotted key (`host.env.HF_TOKEN`, `secrets.hf`, `db@backup.password`) is secret when any part is, as
    `redact` hides everything under a secret key."""
    return any(is_secret_key(part) for part in re.split(r"[./@]", key) if part)


def _keeps(value: Any) -> bool:
    """Values never hidden even under a secret key: nothing, and booleans (`accept_new_host_key: true`)."""
    return value is None or isinstance(value, bool)


def redact_url(value: str) -> str:
    """`https://user:pw@host/` → `https://user:***@host/`, for every URL inside `value`; the rest is unchanged."""
    if "://" not in value or "@" not in value:
        return value
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{REDACTED}@", value)


def redact(value: Any, key: str = "") -> Any:
    """A copy of `value` with every secret replaced by `***`, at any depth."""
    if key and is_secret_key(key) and not _keeps(value):
        return REDACTED
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value


# -- overrides and free text ----------------------------------------------------------------------------------


def _quote_opens(text: str, i: int) -> bool:
    before = text[:i].rstrip()
    return not before or before[-1] in _QUOTE_MAY_FOLLOW


def _quoted_end(text: str, i: int) -> int | None:
    """Index just past the string quoted at `i`, or None when it never closes."""
    quote, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == quote:
            return j + 1
        j += 1
    return None


def _value_end(text: str, start: int, *, stop_at_comma: bool, stop_at_space: bool) -> int:
    """Where the value starting at `start` ends, outside its brackets, quotes and escapes: in a dict literal
    (`stop_at_comma`) at a comma or a closing bracket it did not open; in free text (`stop_at_space`) at
    whitespace or at a comma that starts another `key=`, so a stray `)` or `]` in a password hides the rest of
    it too. An unclosed quote or bracket runs to the end of `text`."""
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char == "\\":  # Hydra's escape (`\,`, `\ `, `\:`): the next character is part of the value
            i += 2
            continue
        if char in "'\"" and _quote_opens(text, i):
            end = _quoted_end(text, i)
            if end is None:
                return len(text)
            i = end
            continue
        if char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            if depth == 0 and stop_at_comma:
                return i
            depth = max(depth - 1, 0)
        elif depth == 0 and ((stop_at_comma and char == ",") or (stop_at_space and char.isspace())):
            return i
        elif depth == 0 and not stop_at_comma and char == "," and _NEXT_OVERRIDE.match(text, i + 1):
            return i  # Hydra's `override_dirname`: `++tracking.password=x,seed=1`; its values escape their commas
        i += 1
    return len(text)


def _redact_value_text(value: str) -> str:
    """`***` in place of a secret value, keeping the whitespace around it."""
    if not value.strip():
        return value
    stripped = value.strip()
    if stripped.lower() in ("true", "false", "null", "none", "~"):
        return value
    leading = value[: len(value) - len(value.lstrip())]
    trailing = value[len(value.rstrip()) :]
    return f"{leading}{REDACTED}{trailing}"


def _redact_dict_literals(text: str) -> str:
    """Secret entries of every `{key: value}` literal in `text` (Hydra's or Python's, at any depth) → `***`."""
    out: list[str] = []
    stack: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char in "'\"" and _quote_opens(text, i):
            end = _quoted_end(text, i)
            if end is not None:
                out.append(text[i:end])
                i = end
                continue
        if char in _OPENERS:
            stack.append(char)
        elif char in _CLOSERS and stack:
            stack.pop()
        out.append(char)
        i += 1
        if char in "{," and stack and stack[-1] == "{":
            entry = _ENTRY_KEY.match(text, i)
            if entry is None:
                continue
            key = next(k for k in entry.groups() if k is not None)
            out.append(text[i : entry.end()])
            i = entry.end()
            if _is_secret_path(key):
                end = _value_end(text, i, stop_at_comma=True, stop_at_space=False)
                out.append(_redact_value_text(text[i:end]))
                i = end
    return "".join(out)


def redact_text(text: str) -> str:
    """Free text (a log line, a string in Hydra's files) with its secrets as `***`: the values of `key=value`
    pairs with a secret key, secret entries of dict literals, and URL passwords."""
    return _redact_text(text, stop_at_space=True)


def _redact_text(text: str, *, stop_at_space: bool) -> str:
    """`stop_at_space=False`: a secret value runs on past whitespace, to the next `,key=` or the end of `text`
    (Hydra's `override_dirname`, whose items may hold spaces)."""
    text = _redact_dict_literals(text)
    out: list[str] = []
    position = 0
    while (match := _TEXT_KEY.search(text, position)) is not None:
        start = match.end()
        out.append(text[position:start])
        if _is_secret_path(match.group(2)):
            end = _value_end(text, start, stop_at_comma=False, stop_at_space=stop_at_space)
            out.append(_redact_value_text(text[start:end]))
            position = end
        else:
            position = start
    out.append(text[position:])
    return redact_url("".join(out))


def redact_override(text: str) -> str:
    """One Hydra command-line override with its secrets as `***`.

    `+host.env.HF_TOKEN=hf_abc` → `+host.env.HF_TOKEN=***` (the key, past any `+`, `++` or `~`, has a secret
    part: its whole value goes, sweeps and spaces included); `host.env={HF_TOKEN:abc,B:1}` →
    `host.env={HF_TOKEN:***,B:1}`; `tracking.uri=https://u:pw@h/` → `tracking.uri=https://u:***@h/`."""
    match = _OVERRIDE_KEY.match(text)
    if match is not None and _is_secret_path(match.group(2)):
        value = text[match.end() :]
        return text[: match.end()] + (_redact_value_text(value).strip() if value.strip() else value)
    return redact_text(text)


def redact_overrides(overrides: Sequence[str]) -> list[str]:
    return [redact_override(str(override)) for override in overrides]


def overrides_tag(overrides: Sequence[str]) -> str:
    """The value of the `hydra.overrides` tag: the redacted overrides joined by spaces, or `(none)`."""
    return " ".join(redact_overrides(overrides)) or "(none)"


# -- Hydra's output files ----------------------------------------------------------------------------------


def _redact_hydra_tree(value: Any, key: str = "", in_list: bool = False) -> Any:
    """Like `redact` (secret keys at any depth: `hydra.sweeper.params`, `hydra.job.env_set`), and every string
    redacted as an override when in a list (`hydra.overrides.task`), else as text whose `key=value` items end
    only at the next `,key=` (`hydra.job.override_dirname`)."""
    if key and _is_secret_path(key) and not _keeps(value):
        return REDACTED
    if isinstance(value, Mapping):
        return {k: _redact_hydra_tree(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_hydra_tree(v, in_list=True) for v in value]
    if isinstance(value, str):
        return redact_override(value) if in_list else _redact_text(value, stop_at_space=False)
    return value


def _rewrite_yaml(path: Path, transform: Callable[[Any], Any]) -> None:
    """Replace `path` atomically with its YAML transformed, keeping its mode; a missing file is skipped."""
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return
    loaded = OmegaConf.load(path)
    before = OmegaConf.to_container(loaded, resolve=False)
    after = transform(before)
    if after == before:
        return
    text = OmegaConf.to_yaml(OmegaConf.create(after))
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def redact_hydra_outputs(folder: Path) -> None:
    """Rewrite in place the files Hydra wrote into a job's output folder (or a multirun's sweep folder) so that
    no secret survives in them: `.hydra/config.yaml`, `.hydra/hydra.yaml`, `.hydra/overrides.yaml` and
    `multirun.yaml`. Missing files are skipped; each file keeps its mode and is replaced atomically."""
    folder = Path(folder)
    _rewrite_yaml(folder / ".hydra" / "config.yaml", redact)
    _rewrite_yaml(folder / ".hydra" / "hydra.yaml", _redact_hydra_tree)
    _rewrite_yaml(folder / ".hydra" / "overrides.yaml", _redact_hydra_tree)
    _rewrite_yaml(folder / "multirun.yaml", _redact_hydra_tree)


# -- logging ------------------------------------------------------------------------------------------------


class RedactingFilter(logging.Filter):
    """Rewrites each record's message (and its traceback) with `redact_text`; never drops a record.

    On Hydra's console and file handlers (conf/config.yaml, `hydra.hydra_logging` and `hydra.job_logging`), so
    that a multirun's `#0 : +host.env.HF_TOKEN=...` line shows `***`."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 -- a bad format string is the handler's to report
            return True
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


# -- MLflow params ------------------------------------------------------------------------------------------


def flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings → dotted keys; lists stay whole values."""
    flat: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping) and item:
            flat.update(flatten(item, f"{name}."))
        else:
            flat[name] = item
    return flat


def to_params(value: Mapping[str, Any], max_length: int) -> dict[str, str]:
    """Redacted, flattened, stringified params; values longer than `max_length` are cut with a marker."""
    params = {}
    for key, item in flatten(redact(value)).items():
        text = "null" if item is None else str(item)
        if len(text) > max_length:
            marker = "…(truncated; whole value in config.yaml)"
            text = text[: max_length - len(marker)] + marker
        params[key] = text
    return params
