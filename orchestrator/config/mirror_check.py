"""A dataset mirror is read only inside itself, and only as the data the paper's sets are.

`experiment.datasets_dir` may be a folder others can write (a shared disk, a mirror copied from elsewhere),
and `datasets` reads a repository folder as it finds it: it follows a symbolic link wherever it points, takes
the files its dataset card names (`configs: data_files:`) relative to the folder, `..` and all, and reads any
format it knows. So a link named `train.csv` that points at a private key became six prompts, uploaded with
the run. Before `datasets` opens a repository folder, it is checked here:

- no symbolic link in it (the folder itself included) leads out of the repository folder;
- the card's `data_files` are relative paths inside the folder (no `..`, no absolute path), and the card's
  metadata is plain YAML (no tags: `yaml.safe_load`);
- its data files are Parquet or JSON (Lines), the formats the paper's sets come in: where the folder is read
  whole, another tabular format `datasets` would take as data (CSV, TSV, Arrow, XML) or a loading script
  (which is never run) is refused; where the set names its files (LiveCodeBench, whose repository holds a
  loading script beside them), only those are read and checked.

Dot folders (`hf download`'s own `.cache/`) are bookkeeping, not data, and are not read. Each refusal is one
line naming the file (control characters escaped) and the fix.

And it is of a size the paper's sets are: their data files hold at most MAX_SET_BYTES together, counted by the
size each file says it has (a sparse file of 20 GiB takes no disk and 400 s to read). The largest real set,
LiveCodeBench's six JSON Lines files with their test cases, is a few GiB; the others are megabytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from orchestrator.config.text import printable

# What the paper's sets are stored as on the hub, and what `datasets` would read as data besides.
DATA_FORMATS = (".parquet", ".json", ".jsonl")
OTHER_DATA = (".csv", ".tsv", ".arrow", ".xml")  # (a licence's .txt, a card's images: not data, left alone)


# The most a set's data files may hold together (see the module).
MAX_SET_BYTES = 16 << 30


class MirrorRefused(ValueError):
    """The repository folder reads outside itself or holds what the paper's sets never do."""


def check_mirror(folder: Path, datasets_dir: Path, files: tuple[str, ...] = ()) -> int:
    """Raise `MirrorRefused` (a line without the set's name: the caller adds it) where reading `folder`, a
    repository under `datasets_dir`, would read outside it or read what is not the paper's data, or more of it
    than the paper's sets hold; else the bytes of data it will read. `files`: the only files the set reads (the
    folder is then not read whole)."""
    inside = folder.resolve()
    if folder.is_symlink() or not inside.is_relative_to(datasets_dir.resolve()):
        raise MirrorRefused(f"{printable(folder)} is a link out of {printable(datasets_dir)}; copy the files in")
    data: list[Path] = []
    if files:
        for name in files:
            path = folder / name
            if not path.resolve().is_relative_to(inside):
                raise MirrorRefused(f"{printable(path)} is a link out of the mirror; copy the file in its place")
            if path.suffix.lower() not in DATA_FORMATS:
                raise MirrorRefused(f"{printable(path)} is not Parquet or JSON Lines")
            data.append(path)
        return _sized(data)
    for root, folders, found in os.walk(folder):  # links to folders are listed, never entered
        here = Path(root)
        folders[:] = [f for f in folders if not f.startswith(".")]  # bookkeeping (`.cache/`), never read
        for name in sorted([*folders, *found]):
            path = here / name
            if path.is_symlink() and not path.resolve().is_relative_to(inside):
                raise MirrorRefused(f"{printable(path)} is a link out of the mirror; copy the file in its place")
            if name.startswith("."):
                continue
            suffix = path.suffix.lower()
            if suffix == ".py":
                raise MirrorRefused(
                    f"{printable(path)} is a loading script, which is never run; the paper's sets are Parquet or "
                    "JSON Lines: download the repository again"
                )
            if path.is_file() and suffix in OTHER_DATA:
                raise MirrorRefused(
                    f"{printable(path)} is a {suffix[1:]} file; the paper's sets are Parquet or JSON Lines: remove it "
                    "or download the repository again"
                )
            if path.is_file() and suffix in DATA_FORMATS:
                data.append(path)
    _check_card(folder / "README.md")
    return _sized(data)


def _sized(data: list[Path]) -> int:
    """The bytes the data files say they hold together; MirrorRefused beyond MAX_SET_BYTES, naming the largest."""
    sizes = {path: path.stat().st_size for path in data}
    total = sum(sizes.values())
    if total > MAX_SET_BYTES:
        largest = max(sizes, key=lambda p: sizes[p])
        raise MirrorRefused(
            f"its data files hold {total / (1 << 30):.1f} GiB ({printable(largest)}: {sizes[largest] / (1 << 30):.1f} "
            f"GiB), more than any of the paper's sets (at most {MAX_SET_BYTES >> 30} GiB): remove what is not the "
            "set, or download the repository again"
        )
    return total


def _check_card(card: Path) -> None:
    """The card's YAML header is plain YAML and names data files inside the folder only."""
    if not card.is_file():
        return
    text = card.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return
    header = text[3:].split("\n---", 1)[0]
    import yaml

    try:
        meta = yaml.safe_load(header)
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        what = f"{printable(card)}: its YAML header does not read as plain YAML ({printable(first)})"
        raise MirrorRefused(f"{what}; download the repository again") from None
    configs = meta.get("configs") if isinstance(meta, dict) else None
    for path in _card_paths(configs):
        parts = Path(path).parts
        if Path(path).is_absolute() or ".." in parts or "://" in path:
            raise MirrorRefused(
                f"{printable(card)} names data files outside the mirror ({printable(path)}); download the repository "
                "again"
            )


def _card_paths(configs: Any) -> list[str]:
    """Every path a card's `configs:` gives (`data_files` as a string, a list, or a list of {split, path})."""
    found: list[str] = []

    def take(value: Any) -> None:
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, list):
            for item in value:
                take(item)
        elif isinstance(value, dict):
            take(value.get("path"))
            take(value.get("data_files"))

    if isinstance(configs, list):
        for config in configs:
            if isinstance(config, dict):
                take(config.get("data_files"))
                take(config.get("data_dir"))
    return found
