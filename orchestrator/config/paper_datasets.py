"""The DDTree paper's ten benchmark prompt sets, built from their Hugging Face datasets as the paper built them.

The protocol is the reference benchmark's (liranringel/ddtree `benchmark.py`, its prompts from DFlash's
`load_and_process_dataset`), so a run here decodes the same conversations the paper's tables report on:

- each set is one hub dataset's config and split (LiveCodeBench: the `json` loader over its six test files,
  in order), and each row becomes one conversation of user turns, written with `str.format` over the row's
  own fields: the data's braces are never read as fields, nothing is stripped, and a field a template only
  sometimes uses (Alpaca's `input`, LiveCodeBench's `starter_code`) is present when Python finds it true, so
  a whitespace-only value counts;
- a set longer than its size N is cut as the reference cuts it, `Dataset.shuffle(seed=0)` then the first N;
  a set of at most N rows is taken whole, in its own order. The rule is the same for every set: AIME 2024/2025,
  HumanEval and MT-Bench are whole because N is their length, not because they are exempt;
- the prompt ids are `<set>-<i>`, i the position in the chosen list; no set has a system message.

The rows come from the hub (the user's network and Hugging Face cache; `HF_HUB_OFFLINE` or
`HF_DATASETS_OFFLINE` keeps them to the cache) or, given a datasets folder, from the mirror
`hf download --repo-type dataset <repo> --local-dir <folder>/<repo>` leaves there, which `datasets` resolves
exactly as it resolves the hub repository (its card's `configs:`, else its file names). A set that cannot be
read is one line naming the repository and the command that fetches it.

`datasets` is imported only when a paper set is asked for: it is heavy, and every config check imports this.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from string import Formatter
from typing import Any

from orchestrator.config.mirror_check import MirrorRefused, check_mirror
from orchestrator.config.text import printable
from remote_worker.heartbeat import beating
from remote_worker.prompt_set import Prompt, PromptSetError, unencodable

Row = Mapping[str, Any]

# `str.format` templates: `{field}` is the row's field, `{{}}` a literal `{}`.
REASON = "\nPlease reason step by step, and put your final answer within \\boxed{{}}."  # after a math problem
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)
SWE_BENCH_TEMPLATE = "Problem Statement:\n{problem_statement}\nPlease fix the issue described above."
LIVECODEBENCH_INSTRUCTION = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate "
    "a correct Python program that matches the specification and passes all tests. You will NOT return anything "
    "except for the program"
)
LIVECODEBENCH_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")
SHUFFLE_SEED = 0


class _NoField(Exception):
    """A row lacks a field its prompt needs (or holds something other than the text the prompt reads)."""

    def __init__(self, field: str, wanted: str = "text", holds: str | None = None) -> None:
        super().__init__(field)
        self.field, self.wanted, self.holds = field, wanted, holds

    def says(self) -> str:
        if self.holds is not None:
            return f"holds {self.holds} in its field {self.field!r}"
        return f"has no {self.wanted} in its field {self.field!r}"


def _checked(field: str, value: str) -> str:
    """`value`, when a tokenizer can encode it: every other character (line and paragraph separators, NUL,
    a BOM, CR) travels as it is, escaped in the prompt file."""
    reason = unencodable(value)
    if reason is not None:
        raise _NoField(field, holds=reason)
    return value


def _text(row: Row, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        raise _NoField(field)
    return _checked(field, value)


def _template(template: str) -> Callable[[Row], list[str]]:
    """One user turn: `template` formatted with the row's fields (each needed one must be text)."""
    fields = [field for _, field, _, _ in Formatter().parse(template) if field is not None]
    return lambda row: [template.format(**{field: _text(row, field) for field in fields})]


def _alpaca(row: Row) -> list[str]:
    instruction = _text(row, "instruction")
    return [f"{instruction}\n\nInput:\n{_text(row, 'input')}" if row.get("input") else instruction]


def _livecodebench(row: Row) -> list[str]:
    if row.get("starter_code"):
        code_format = f"### Format: Use the following code structure:\n```python\n{_text(row, 'starter_code')}\n```"
    else:
        code_format = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    question = _text(row, "question_content")
    answer = "### Answer: (use the provided format with backticks)"
    return [f"{LIVECODEBENCH_INSTRUCTION}\n\n### Question:\n{question}\n\n{code_format}\n\n{answer}"]


def _mt_bench(row: Row) -> list[str]:
    turns = row.get("prompt")
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) for turn in turns):
        raise _NoField("prompt", "list of turns")
    return [_checked("prompt", turn) for turn in turns]


@dataclass(frozen=True)
class PaperSet:
    """One benchmark set: where its rows live, how many the paper decodes, and how a row becomes its turns."""

    name: str
    repo: str  # the hub dataset, also its folder under a datasets folder
    config: str | None
    split: str
    size: int  # N: a longer set is cut to N rows (shuffled with seed 0 first), a shorter one taken whole
    turns: Callable[[Row], list[str]]  # the row's user turns in order: the first opens the conversation
    columns: tuple[str, ...]  # the fields `turns` reads; only these are pulled out of each row
    files: tuple[str, ...] = ()  # read with the `json` loader from these files of the repo, in order


PAPER_SETS: tuple[PaperSet, ...] = (
    PaperSet("gsm8k", "openai/gsm8k", "main", "test", 128, _template("{question}" + REASON), ("question",)),
    PaperSet("math500", "HuggingFaceH4/MATH-500", None, "test", 128, _template("{problem}" + REASON), ("problem",)),
    PaperSet("aime24", "HuggingFaceH4/aime_2024", None, "train", 30, _template("{problem}" + REASON), ("problem",)),
    PaperSet("aime25", "MathArena/aime_2025", None, "train", 30, _template("{problem}" + REASON), ("problem",)),
    PaperSet("humaneval", "openai/openai_humaneval", None, "test", 164, _template(HUMANEVAL_TEMPLATE), ("prompt",)),
    PaperSet("mbpp", "google-research-datasets/mbpp", "sanitized", "test", 128, _template("{prompt}"), ("prompt",)),
    PaperSet(
        "livecodebench",
        "livecodebench/code_generation_lite",
        None,
        "train",  # the `json` loader's one split
        128,
        _livecodebench,
        ("question_content", "starter_code"),
        files=LIVECODEBENCH_FILES,
    ),
    PaperSet(
        "swe-bench",
        "princeton-nlp/SWE-bench_Lite",
        None,
        "test",
        128,
        _template(SWE_BENCH_TEMPLATE),
        ("problem_statement",),
    ),
    PaperSet("mt-bench", "HuggingFaceH4/mt_bench_prompts", None, "train", 80, _mt_bench, ("prompt",)),
    PaperSet("alpaca", "tatsu-lab/alpaca", None, "train", 128, _alpaca, ("instruction", "input")),
)
PAPER_SET_NAMES = tuple(paper_set.name for paper_set in PAPER_SETS)
_BY_NAME = {paper_set.name: paper_set for paper_set in PAPER_SETS}


def download_command(repo: str, datasets_dir: Path | None) -> str:
    """The command that puts `repo` where a datasets folder is read from."""
    folder = f"{datasets_dir}/{repo}" if datasets_dir is not None else f"<datasets folder>/{repo}"
    return f"hf download --repo-type dataset {repo} --local-dir {folder}"


def _one_line(exc: BaseException) -> str:
    """The error's type and its message's first line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def mirror_cache(folder: Path, cache_root: Path) -> Path:
    """Where `datasets` keeps its prepared copy of the mirrored repository `folder`: under `cache_root`, in a
    folder named by a digest of the mirror's path and of its files' names, sizes and modification times.

    `datasets` keys a local folder's prepared copy on neither the folder's path nor its files: a mirror
    updated in place, or a second mirror of the same repository, was read from the first one's copy (a sweep
    over a 6-row mirror decoded the 3 rows of a mirror made earlier elsewhere). Dot folders (`hf download`'s
    own `.cache/`) are left out: they are bookkeeping, not data."""
    digest = hashlib.sha256(str(folder.resolve()).encode())
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        stat = path.stat()
        digest.update(f"\0{relative.as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return cache_root / "mirrors" / f"{folder.name}-{digest.hexdigest()[:16]}"


class _HubLines(logging.Handler):
    """The hub client's log lines while a set is read, kept off the terminal: they print URLs, a mirror's file
    names raw and five lines per retry. Its first retry becomes one line of ours, so that the wait it starts
    (about 30 s of backoff before the read fails) is not silent, with what avoids it."""

    def __init__(self, set_name: str) -> None:
        super().__init__(logging.WARNING)
        self.set_name = set_name
        self.said = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.said or "Retrying in" not in record.getMessage():
            return
        self.said = True
        print(
            f"{self.set_name}: the Hugging Face hub does not answer; retrying for about 30 s "
            "(HF_DATASETS_OFFLINE=1 reads the cache alone; experiment.datasets_dir=<folder> reads a mirror)",
            file=sys.stderr,
            flush=True,
        )


# A mirror's first read converts its data into `datasets`' prepared copy: from this size on it takes long
# enough (LiveCodeBench's few GiB: minutes) to be said, and then said again every PREPARING_EVERY_S.
PREPARING_FROM_BYTES = 64 << 20
PREPARING_EVERY_S = 15.0


@dataclass
class _Preparing:
    """What a long first read of a mirror says while `datasets` prepares its copy: a line as it starts, then one
    every PREPARING_EVERY_S with the time so far and the bytes the copy holds by then (no wait is silent)."""

    set_name: str
    size: int  # the mirror's data bytes
    cache: Path  # where the prepared copy grows

    def first_line(self) -> str:
        return (
            f"{self.set_name}: preparing {_size(self.size)} of mirrored data for reading (once: later reads take "
            f"the prepared copy in {printable(str(self.cache))})"
        )

    def line(self, elapsed_s: float) -> str:
        return f"{self.set_name}: still preparing ({elapsed_s:.0f} s; {_size(_bytes_under(self.cache))} written)"


def _size(count: int) -> str:
    return f"{count / (1 << 30):.1f} GiB" if count >= 1 << 30 else f"{count / (1 << 20):.0f} MiB"


def _bytes_under(folder: Path) -> int:
    total = 0
    for root, _folders, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # written and renamed meanwhile
    return total


@contextmanager
def _preparing_said(set_name: str, size: int | None, cache: Path | None) -> Iterator[None]:
    """`_Preparing`'s lines while the block reads a mirror of `size` data bytes whose prepared copy is not made yet
    (None: from the hub, whose client says its own progress)."""
    if size is None or cache is None or size < PREPARING_FROM_BYTES or (cache.is_dir() and any(cache.iterdir())):
        yield
        return
    preparing, started = _Preparing(set_name, size, cache), time.monotonic()
    print(preparing.first_line(), file=sys.stderr, flush=True)

    def say() -> None:
        print(preparing.line(time.monotonic() - started), file=sys.stderr, flush=True)

    with beating(PREPARING_EVERY_S, say, "mirror-progress"):
        yield


@contextmanager
def _hub_lines_held(set_name: str) -> Iterator[None]:
    logger = logging.getLogger("huggingface_hub")
    saved, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [_HubLines(set_name)], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = saved, propagate


def _rows(paper_set: PaperSet, datasets_dir: Path | None) -> Any:
    """The set's whole split as a `datasets.Dataset`, from the hub or the mirror under `datasets_dir`."""
    import datasets
    from datasets.exceptions import DatasetGenerationError, DatasetsError
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HTTPError

    # Its progress bars and log lines stay off the terminal: what went wrong is our one line below, its cause
    # included, and a log line would print a mirror's file names raw (escape sequences and all).
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    name, repo = paper_set.name, paper_set.repo
    fetch = download_command(repo, datasets_dir)
    if datasets_dir is not None:
        folder = datasets_dir / repo
        if not folder.is_dir():
            raise PromptSetError(f"{name}: {repo} is not in {datasets_dir}; download it with: {fetch}")
        missing = [file for file in paper_set.files if not (folder / file).is_file()]
        if missing:
            raise PromptSetError(f"{name}: {folder} has no {missing[0]}; download it again with: {fetch}")
        try:  # read only inside itself, only as the paper's data and at most its size (`mirror_check`)
            size = check_mirror(folder, datasets_dir, paper_set.files)
        except (MirrorRefused, OSError) as exc:
            raise PromptSetError(f"{name}: {exc}") from None
        where = f"from {folder}"
    else:
        size, where = None, "from the Hugging Face hub"
    # A mirror's prepared copy is keyed on its files (`mirror_cache`); the hub's on the repository's revision.
    prepared = (
        None if datasets_dir is None else mirror_cache(datasets_dir / repo, Path(datasets.config.HF_DATASETS_CACHE))
    )
    cache = None if prepared is None else str(prepared)
    # the hub client's retries said once, in a line of ours; a mirror's long first read said as it goes
    with _hub_lines_held(name), _preparing_said(name, size, prepared):
        try:
            if not paper_set.files:
                source = str(datasets_dir / repo) if datasets_dir is not None else repo
                return datasets.load_dataset(source, paper_set.config, split=paper_set.split, cache_dir=cache)
            if datasets_dir is not None:
                files = [str(datasets_dir / repo / file) for file in paper_set.files]
            else:  # through the hub's cache, so a set read once is there offline too (offline as `datasets` says)
                offline = datasets.config.HF_HUB_OFFLINE
                files = [
                    hf_hub_download(repo, f, repo_type="dataset", local_files_only=offline) for f in paper_set.files
                ]
            return datasets.load_dataset("json", data_files=files, split=paper_set.split, cache_dir=cache)
        except (OSError, ValueError, HTTPError, DatasetsError) as exc:  # no hub, offline without a cache, a bad mirror
            cause = exc.__cause__ if isinstance(exc, DatasetGenerationError) and exc.__cause__ else exc  # the real one
            raise PromptSetError(
                f"{name}: {repo} cannot be read {where} ({_one_line(cause)}); download it with: {fetch}"
            ) from exc


def _row(rows: Any, i: int) -> Row:
    """Row `i` as Python values; bytes that are not UTF-8 in a text column (Arrow stores them unchecked) name
    the column instead of stopping the load with a traceback."""
    try:
        return rows[i]
    except UnicodeDecodeError as exc:
        for column in rows.column_names:
            try:
                rows.select_columns([column])[i]
            except UnicodeDecodeError:
                raise _NoField(column, holds=f"bytes that are not UTF-8 ({exc.reason})") from None
        raise _NoField("?", holds=f"bytes that are not UTF-8 ({exc.reason})") from None


@functools.cache  # keyed on (name, datasets_dir)
def _load(name: str, datasets_dir: Path | None) -> tuple[Prompt, ...]:
    paper_set = _BY_NAME[name]
    rows = _rows(paper_set, datasets_dir)
    if len(rows) > paper_set.size:
        rows = rows.shuffle(seed=SHUFFLE_SEED).select(range(paper_set.size))
    present = [column for column in paper_set.columns if column in rows.column_names]
    if present:  # only what the prompt reads: LiveCodeBench's test cases are large (none: the rows report it)
        rows = rows.select_columns(present)
    prompts = []
    for i in range(len(rows)):
        prompt_id = f"{name}-{i}"
        try:
            first, *later = paper_set.turns(_row(rows, i))
        except _NoField as missing:
            raise PromptSetError(f"{name}: row {i} ({prompt_id}) of {paper_set.repo} {missing.says()}") from None
        prompts.append(Prompt(id=prompt_id, messages=[{"role": "user", "content": first}], followups=tuple(later)))
    if not prompts:
        raise PromptSetError(f"{name}: {paper_set.repo} has no rows in its {paper_set.split} split")
    return tuple(prompts)


def load_paper_set(name: str, datasets_dir: Path | None) -> list[Prompt]:
    """The paper's prompts for set `name` (one of PAPER_SET_NAMES): from the hub when `datasets_dir` is None,
    else from its mirror there. Read once per process: the config check, the prompt-length check and the
    launch all ask for it."""
    if name not in _BY_NAME:
        raise PromptSetError(f"{name!r} is not one of the paper's sets ({', '.join(PAPER_SET_NAMES)})")
    return list(_load(name, datasets_dir))
