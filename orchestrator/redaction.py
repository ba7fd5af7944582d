"""Keep secrets out of MLflow: redact secret-looking keys and URL passwords, flatten config into params."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"
# Whole words of a key (split on anything not a letter or digit) that mark its value as a secret.
# Whole words, so that `max_new_tokens` is a setting while `HF_TOKEN` and `db_password` are secrets.
SECRET_WORDS = frozenset({"password", "passwd", "passphrase", "token", "secret", "credentials", "apikey"})
_WORD = re.compile(r"[A-Za-z0-9]+")
_API_KEY = re.compile(r"api[_-]?key", re.IGNORECASE)


def is_secret_key(key: str) -> bool:
    words = {w.lower() for w in _WORD.findall(key)}
    return bool(words & SECRET_WORDS) or bool(_API_KEY.search(key))


def redact_url(value: str) -> str:
    """`https://user:pw@host/` → `https://user:***@host/`; anything else is returned unchanged."""
    if "://" not in value or "@" not in value:
        return value
    parts = urlsplit(value)
    if parts.password is None:
        return value
    netloc = parts.netloc.replace(f":{parts.password}@", f":{REDACTED}@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def redact(value: Any, key: str = "") -> Any:
    """A copy of `value` with every secret replaced by `***`, at any depth."""
    if key and is_secret_key(key) and value is not None:
        return REDACTED
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value


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
