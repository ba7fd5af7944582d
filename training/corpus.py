"""The training text: this interpreter's standard library sources, split by file into train and held out.

A file is held out when the hash of its relative path says so (1 in 20), so the split is the same on every
machine with the same Python version, and held-out prompts come from files the models never saw.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from pathlib import Path

import torch

HELD_OUT_ONE_IN = 20


def _held_out(relative: str) -> bool:
    return hashlib.sha256(relative.encode()).digest()[0] % HELD_OUT_ONE_IN == 0


def stdlib_files(held_out: bool) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "site-packages" in relative or "/test" in f"/{relative}" or "idlelib" in relative:
            continue
        if _held_out(relative) == held_out:
            files.append(path)
    return files


def corpus(held_out: bool, limit_bytes: int) -> torch.Tensor:
    """The files' bytes, each followed by two newlines, up to `limit_bytes`."""
    data = bytearray()
    for path in stdlib_files(held_out):
        data += path.read_bytes() + b"\n\n"
        if len(data) >= limit_bytes:
            break
    return torch.frombuffer(data[:limit_bytes], dtype=torch.uint8).long()


def windows(data: torch.Tensor, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.shape[0] - length, (count,), generator=generator)
    return torch.stack([data[s : s + length] for s in starts.tolist()])


def held_out_prompts(count: int, prefix_bytes: int, seed: int) -> list[dict]:
    """Chat-turn lines whose content is the start of a function from a held-out file, up to its body."""
    rng = random.Random(seed)
    candidates = []
    for path in stdlib_files(held_out=True):
        text = path.read_text(encoding="utf-8", errors="replace")
        for index, line in enumerate(text.splitlines(keepends=True)):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                start = sum(len(x) for x in text.splitlines(keepends=True)[:index])
                snippet = text[start : start + prefix_bytes]
                if snippet.isascii() and len(snippet) == prefix_bytes:
                    candidates.append((path.stem, snippet))
    chosen = rng.sample(candidates, count)
    return [
        {"id": f"heldout-{stem}-{number}", "messages": [{"role": "user", "content": snippet}]}
        for number, (stem, snippet) in enumerate(chosen)
    ]


def write_prompts(path: Path, prompts: list[dict]) -> None:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
