"""Counts in words: `1 prompt`, `2 prompts`. Every line the user reads says a count this way."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun`, the noun plural unless the count is one (`plural` where an `s` will not do)."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"  # 2,304 records
