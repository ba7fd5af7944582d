"""A local mirror of the DDTree paper's ten benchmark datasets, in each hub repository's own layout, with a few
synthetic rows: what `hf download --repo-type dataset <repo> --local-dir <root>/<repo>` would leave, small.

The layout is the real one (parquet shards named as the hub names them, a README whose YAML `configs:` maps
them where the real card does, JSON lines where the repository holds those), so `datasets` resolves each
folder exactly as it would resolve the download, and a loader that reads the wrong config or split finds the
decoy rows that sit beside the right ones. Every row carries the real columns, not only the ones a prompt
reads, so a loader that trips over the others is caught too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

Row = dict[str, Any]

LIVECODEBENCH_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")


def _card(*configs: tuple[str, dict[str, str], bool]) -> str:
    """A dataset card whose YAML maps each (config, {split: pattern}, default) as the hub's cards do."""
    lines = ["---", "configs:"]
    for name, splits, default in configs:
        lines.append(f"- config_name: {name}")
        lines.append("  data_files:")
        for split, path in splits.items():
            lines += [f"  - split: {split}", f"    path: {path}"]
        if default:
            lines.append("  default: true")
    return "\n".join([*lines, "---", "", "A synthetic mirror for tests.", ""])


def _parquet(path: Path, rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _jsonl(path: Path, rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def gsm8k_row(i: int, tag: str = "") -> Row:
    return {"question": f"{tag}Natalia sold {i} clips. How many?", "answer": f"#### {i}"}


def math500_row(i: int) -> Row:
    return {
        "problem": f"What is ${i} + 1$?",
        "solution": f"It is ${i + 1}$.",
        "answer": str(i + 1),
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": f"test/prealgebra/{i}.json",
    }


def aime24_row(i: int) -> Row:
    return {
        "id": 60 + i,
        "problem": f"AIME 2024 problem {i}",
        "solution": "…",
        "answer": str(i),
        "url": f"https://example.org/{i}",
        "year": "2024",
    }


def aime25_row(i: int) -> Row:
    return {"problem_idx": i + 1, "problem": f"AIME 2025 problem {i}", "answer": i, "problem_type": ["Algebra"]}


def humaneval_row(i: int) -> Row:
    return {
        "task_id": f"HumanEval/{i}",
        "prompt": f'def f{i}(x: int) -> int:\n    """Return x plus {i}."""\n',
        "canonical_solution": f"    return x + {i}\n",
        "test": f"def check(candidate):\n    assert candidate(0) == {i}\n",
        "entry_point": f"f{i}",
    }


def mbpp_row(i: int, tag: str = "") -> Row:
    return {
        "source_file": "Benchmark Questions Verification V2.ipynb",
        "task_id": 11 + i,
        "prompt": f"{tag}Write a python function to add {i}.",
        "code": f"def add(x):\n    return x + {i}",
        "test_imports": [],
        "test_list": [f"assert add(0) == {i}"],
    }


def swe_bench_row(i: int, tag: str = "") -> Row:
    return {
        "repo": "astropy/astropy",
        "instance_id": f"astropy__astropy-{12907 + i}",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "patch": "diff --git a/x b/x",
        "test_patch": "diff --git a/t b/t",
        "problem_statement": f"{tag}Issue {i}: modeling's separability_matrix is wrong.\n",
        "hints_text": "",
        "created_at": "2022-03-03T15:14:54Z",
        "version": "4.3",
        "FAIL_TO_PASS": "[]",
        "PASS_TO_PASS": "[]",
        "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
    }


def mt_bench_row(i: int) -> Row:
    return {
        "prompt": [f"Write a travel blog post, part {i}.", f"Rewrite it, part {i}, starting every sentence with A."],
        "prompt_id": 81 + i,
        "category": "writing",
        "reference": [],
    }


def alpaca_row(i: int) -> Row:
    return {
        "instruction": f"Give three tips number {i}.",
        "input": "" if i % 2 == 0 else f"context {i}",
        "output": "1. Eat well.",
        "text": "Below is an instruction…",
    }


def livecodebench_row(i: int, tag: str = "") -> Row:
    return {
        "question_title": f"{tag}problem {i}",
        "question_content": f"{tag}Given N, print N + {i}.",
        "platform": "atcoder",
        "question_id": f"abc{300 + i}_a",
        "contest_id": f"abc{300 + i}",
        "contest_date": "2023-05-06T00:00:00",
        "starter_code": "" if i % 2 == 0 else "class Solution:\n    def f(self, n: int) -> int:\n        ",
        "difficulty": "easy",
        "public_test_cases": '[{"input": "1", "output": "2", "testtype": "stdin"}]',
        "private_test_cases": "eJyrVg==",
        "metadata": "{}",
    }


SYNTHETIC: Mapping[str, Callable[[int], Row]] = {
    "gsm8k": gsm8k_row,
    "math500": math500_row,
    "aime24": aime24_row,
    "aime25": aime25_row,
    "humaneval": humaneval_row,
    "mbpp": mbpp_row,
    "livecodebench": livecodebench_row,
    "swe-bench": swe_bench_row,
    "mt-bench": mt_bench_row,
    "alpaca": alpaca_row,
}


# Text a scraped dataset holds, in every prompt column of an `odd` mirror: each Unicode line and paragraph
# separator (what `str.splitlines` breaks on besides \n), NUL, a BOM, CR and CRLF, zero-width and bidi marks,
# a combining accent, astral emoji, CJK, and braces a template must not read.
ODD_TEXT = (
    " [\u2028 LS \u2029 PS \x85 NEL \x0b VT \x0c FF \x1c FS \x1d GS \x1e RS \r CR \r\n CRLF \x00 NUL"
    ' \ufeff BOM \u200b ZWSP \u202e RLO \u202c e\u0301 中文 🧪 {x} {{}} \\ " \t]'
)
PROMPT_COLUMNS: Mapping[str, tuple[str, ...]] = {
    "gsm8k": ("question",),
    "math500": ("problem",),
    "aime24": ("problem",),
    "aime25": ("problem",),
    "humaneval": ("prompt",),
    "mbpp": ("prompt",),
    "livecodebench": ("question_content", "starter_code"),
    "swe-bench": ("problem_statement",),
    "mt-bench": ("prompt",),
    "alpaca": ("instruction", "input"),
}


def with_odd_text(name: str, row: Row) -> Row:
    """`row` with ODD_TEXT after the text of each column the set's prompt reads (each turn of MT-Bench)."""
    out = dict(row)
    for column in PROMPT_COLUMNS[name]:
        value = out.get(column)
        out[column] = [turn + ODD_TEXT for turn in value] if isinstance(value, list) else (value or "") + ODD_TEXT
    return out


def _chunks(rows: list[Row], parts: int) -> list[list[Row]]:
    """`rows` cut into `parts` consecutive runs, the earlier ones one longer where they do not divide."""
    size, extra = divmod(len(rows), parts)
    out, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        out.append(rows[start:end])
        start = end
    return out


def build_mirror(
    root: Path, rows_per_set: int = 3, rows: Mapping[str, list[Row]] | None = None, odd: bool = False
) -> Path:
    """Mirrors of all ten repositories under `root` (the datasets folder), and `root`.

    Each set's benchmark split gets `rows_per_set` synthetic rows (LiveCodeBench: each of its six files), or
    the rows `rows` gives under the set's name (LiveCodeBench's are cut into six consecutive runs, one per
    file, test.jsonl first, so read in file order they are the list's order). The other configs and splits
    hold decoys tagged `WRONG`. `odd`: every synthetic row's prompt columns end with ODD_TEXT."""
    given = dict(rows or {})
    if odd:
        given = {
            name: [
                with_odd_text(name, row) for row in given.get(name, [SYNTHETIC[name](i) for i in range(rows_per_set)])
            ]
            for name in SYNTHETIC
            if name != "livecodebench" or name in given
        }

    def main(name: str) -> list[Row]:
        return given[name] if name in given else [SYNTHETIC[name](i) for i in range(rows_per_set)]

    repo = root / "openai" / "gsm8k"
    _parquet(repo / "main" / "test-00000-of-00001.parquet", main("gsm8k"))
    _parquet(repo / "main" / "train-00000-of-00001.parquet", [gsm8k_row(0, "WRONG split ")])
    _parquet(repo / "socratic" / "test-00000-of-00001.parquet", [gsm8k_row(0, "WRONG config ")])
    _parquet(repo / "socratic" / "train-00000-of-00001.parquet", [gsm8k_row(1, "WRONG config ")])
    (repo / "README.md").write_text(
        _card(
            ("main", {"train": "main/train-*", "test": "main/test-*"}, False),
            ("socratic", {"train": "socratic/train-*", "test": "socratic/test-*"}, False),
        )
    )

    repo = root / "HuggingFaceH4" / "MATH-500"  # one JSON lines file; its card declares no configs
    _jsonl(repo / "test.jsonl", main("math500"))
    (repo / "README.md").write_text("---\nlicense: mit\n---\n\nA synthetic mirror for tests.\n")

    for name, repo in (("aime24", root / "HuggingFaceH4" / "aime_2024"), ("aime25", root / "MathArena" / "aime_2025")):
        _parquet(repo / "data" / "train-00000-of-00001.parquet", main(name))
        (repo / "README.md").write_text(_card(("default", {"train": "data/train-*"}, False)))

    repo = root / "openai" / "openai_humaneval"
    _parquet(repo / "openai_humaneval" / "test-00000-of-00001.parquet", main("humaneval"))
    (repo / "README.md").write_text(_card(("openai_humaneval", {"test": "openai_humaneval/test-*"}, True)))

    repo = root / "google-research-datasets" / "mbpp"
    splits = ("train", "test", "validation", "prompt")
    for split in splits:
        _parquet(repo / "full" / f"{split}-00000-of-00001.parquet", [mbpp_row(0, "WRONG config ")])
        sanitized = main("mbpp") if split == "test" else [mbpp_row(0, "WRONG split ")]
        _parquet(repo / "sanitized" / f"{split}-00000-of-00001.parquet", sanitized)
    (repo / "README.md").write_text(
        _card(
            ("full", {split: f"full/{split}-*" for split in splits}, True),
            ("sanitized", {split: f"sanitized/{split}-*" for split in splits}, False),
        )
    )

    repo = root / "livecodebench" / "code_generation_lite"  # six JSON lines files beside a loading script
    if "livecodebench" in given:
        per_file = _chunks(given["livecodebench"], len(LIVECODEBENCH_FILES))
    else:
        per_file = [[livecodebench_row(i, f"{name} ") for i in range(rows_per_set)] for name in LIVECODEBENCH_FILES]
        if odd:
            per_file = [[with_odd_text("livecodebench", row) for row in chunk] for chunk in per_file]
    for name, chunk in zip(LIVECODEBENCH_FILES, per_file, strict=True):
        _jsonl(repo / name, chunk)
    (repo / "code_generation_lite.py").write_text("raise RuntimeError('a loading script must not run')\n")
    (repo / "README.md").write_text("---\nlicense: cc\n---\n\nA synthetic mirror for tests.\n")

    repo = root / "princeton-nlp" / "SWE-bench_Lite"
    _parquet(repo / "data" / "test-00000-of-00001.parquet", main("swe-bench"))
    _parquet(repo / "data" / "dev-00000-of-00001.parquet", [swe_bench_row(0, "WRONG split ")])
    (repo / "README.md").write_text(_card(("default", {"dev": "data/dev-*", "test": "data/test-*"}, False)))

    repo = root / "HuggingFaceH4" / "mt_bench_prompts"
    _parquet(repo / "data" / "train-00000-of-00001.parquet", main("mt-bench"))
    (repo / "README.md").write_text(_card(("default", {"train": "data/train-*"}, False)))

    repo = root / "tatsu-lab" / "alpaca"
    _parquet(repo / "data" / "train-00000-of-00001-a09b74b3ef9c3b56.parquet", main("alpaca"))
    (repo / "README.md").write_text(_card(("default", {"train": "data/train-*"}, False)))
    return root
