"""The paper's ten benchmark sets are the reference benchmark's prompts, character for character, and the same
rows of each dataset, read from a local mirror in the hub's own layout (`tests/paper_mirror.py`).

The expected prompts are written out here, not rebuilt from the module's templates, and the expected subset is
computed by `datasets`' own shuffle on the rows the test wrote: a wrong newline, brace, config, split, file
order or seed fails here.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import datasets
import pytest

from orchestrator.config import paper_datasets
from orchestrator.config.paper_datasets import PAPER_SET_NAMES, PAPER_SETS, load_paper_set
from orchestrator.config.prompts import NAMED_SETS, humaneval_prompts, prompts_file_text, resolve_prompts
from remote_worker.prompt_set import Prompt, PromptSetError, parse_prompts
from tests.paper_mirror import (
    SYNTHETIC,
    aime24_row,
    aime25_row,
    alpaca_row,
    build_mirror,
    gsm8k_row,
    humaneval_row,
    livecodebench_row,
    math500_row,
    mbpp_row,
    mt_bench_row,
    swe_bench_row,
)

REASON = "Please reason step by step, and put your final answer within \\boxed{}."
LCB = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate a "
    "correct Python program that matches the specification and passes all tests. You will NOT return anything except "
    "for the program\n\n### Question:\n"
)
LCB_OWN_FORMAT = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
LCB_STARTER = "### Format: Use the following code structure:\n```python\n"
LCB_ANSWER = "### Answer: (use the provided format with backticks)"
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
STARTER = "class Solution:\n    def f(self, s: str) -> int:\n        "


pytestmark = pytest.mark.usefixtures("datasets_cache")  # tests/conftest.py: a cache of their own, read afresh


def user(content: str, prompt_id: str, *followups: str) -> Prompt:
    return Prompt(id=prompt_id, messages=[{"role": "user", "content": content}], followups=tuple(followups))


# Rows whose text tests the formatting: braces of every kind, surrounding whitespace, `\boxed{}`, CRLF, and
# each conditional field absent, empty, whitespace-only and present.
ROWS: dict[str, list[dict[str, Any]]] = {
    "gsm8k": [
        {**gsm8k_row(0), "question": "Tom has {x} apples and {} pears; {0} {{y}} %s.\n"},
        {**gsm8k_row(1), "question": "  padded  "},
    ],
    "math500": [{**math500_row(0), "problem": "Find $\\frac{1}{2}$ of \\boxed{3}."}],
    "aime24": [{**aime24_row(0), "problem": "Let $x^{2}=4$. Find {x}."}],
    "aime25": [{**aime25_row(0), "problem": "AIME 2025 {problem}"}],
    "humaneval": [{**humaneval_row(0), "prompt": 'def f(d: dict) -> str:\n    """Return f"{d}" for {}."""\n'}],
    "mbpp": [{**mbpp_row(0), "prompt": "Write a function to format '{name}'.  "}],
    "livecodebench": [
        {**livecodebench_row(0), "question_content": "Read {N}.\n", "starter_code": ""},
        {**livecodebench_row(1), "question_content": "Q1", "starter_code": STARTER},
        {**livecodebench_row(2), "question_content": "Q2", "starter_code": "   "},
        {**livecodebench_row(3), "question_content": "Q3", "starter_code": None},
        {**livecodebench_row(4), "question_content": "Q4", "starter_code": "def f({}):"},
        {**livecodebench_row(5), "question_content": "Q5", "starter_code": "\n"},
    ],
    "swe-bench": [{**swe_bench_row(0), "problem_statement": "Fix {this} in `d = {}`.\r\n"}],
    "mt-bench": [
        {**mt_bench_row(0), "prompt": ["Turn one {x}.", "Turn two."]},
        {**mt_bench_row(1), "prompt": ["Only turn."]},
        {**mt_bench_row(2), "prompt": ["A", "B", "C"]},
    ],
    "alpaca": [
        {**alpaca_row(0), "instruction": "Summarize {this}.", "input": ""},
        {**alpaca_row(1), "instruction": "Translate.", "input": "   "},
        {**alpaca_row(2), "instruction": "Sort.", "input": "[3, {1}, 2]"},
    ],
}

EXPECTED: dict[str, list[Prompt]] = {
    "gsm8k": [
        user("Tom has {x} apples and {} pears; {0} {{y}} %s.\n\n" + REASON, "gsm8k-0"),
        user("  padded  \n" + REASON, "gsm8k-1"),
    ],
    "math500": [user("Find $\\frac{1}{2}$ of \\boxed{3}.\n" + REASON, "math500-0")],
    "aime24": [user("Let $x^{2}=4$. Find {x}.\n" + REASON, "aime24-0")],
    "aime25": [user("AIME 2025 {problem}\n" + REASON, "aime25-0")],
    "humaneval": [user(HUMANEVAL + 'def f(d: dict) -> str:\n    """Return f"{d}" for {}."""\n\n```', "humaneval-0")],
    "mbpp": [user("Write a function to format '{name}'.  ", "mbpp-0")],
    "livecodebench": [
        user(LCB + "Read {N}.\n\n\n" + LCB_OWN_FORMAT + "\n\n" + LCB_ANSWER, "livecodebench-0"),
        user(LCB + "Q1\n\n" + LCB_STARTER + STARTER + "\n```\n\n" + LCB_ANSWER, "livecodebench-1"),
        user(LCB + "Q2\n\n" + LCB_STARTER + "   \n```\n\n" + LCB_ANSWER, "livecodebench-2"),
        user(LCB + "Q3\n\n" + LCB_OWN_FORMAT + "\n\n" + LCB_ANSWER, "livecodebench-3"),
        user(LCB + "Q4\n\n" + LCB_STARTER + "def f({}):\n```\n\n" + LCB_ANSWER, "livecodebench-4"),
        user(LCB + "Q5\n\n" + LCB_STARTER + "\n\n```\n\n" + LCB_ANSWER, "livecodebench-5"),
    ],
    "swe-bench": [
        user("Problem Statement:\nFix {this} in `d = {}`.\r\n\nPlease fix the issue described above.", "swe-bench-0")
    ],
    "mt-bench": [
        user("Turn one {x}.", "mt-bench-0", "Turn two."),
        user("Only turn.", "mt-bench-1"),
        user("A", "mt-bench-2", "B", "C"),
    ],
    "alpaca": [
        user("Summarize {this}.", "alpaca-0"),
        user("Translate.\n\nInput:\n   ", "alpaca-1"),
        user("Sort.\n\nInput:\n[3, {1}, 2]", "alpaca-2"),
    ],
}


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mirror(tmp_path_factory.mktemp("datasets"), rows=ROWS)


def test_the_table_is_the_papers() -> None:
    table = [(s.name, s.repo, s.config, s.split, s.size) for s in PAPER_SETS]
    assert table == [
        ("gsm8k", "openai/gsm8k", "main", "test", 128),
        ("math500", "HuggingFaceH4/MATH-500", None, "test", 128),
        ("aime24", "HuggingFaceH4/aime_2024", None, "train", 30),
        ("aime25", "MathArena/aime_2025", None, "train", 30),
        ("humaneval", "openai/openai_humaneval", None, "test", 164),
        ("mbpp", "google-research-datasets/mbpp", "sanitized", "test", 128),
        ("livecodebench", "livecodebench/code_generation_lite", None, "train", 128),
        ("swe-bench", "princeton-nlp/SWE-bench_Lite", None, "test", 128),
        ("mt-bench", "HuggingFaceH4/mt_bench_prompts", None, "train", 80),
        ("alpaca", "tatsu-lab/alpaca", None, "train", 128),
    ]
    assert tuple(name for name, *_ in table) == PAPER_SET_NAMES
    assert set(PAPER_SET_NAMES) < set(NAMED_SETS) and "humaneval_completion" in NAMED_SETS


@pytest.mark.parametrize("name", PAPER_SET_NAMES)
def test_each_set_is_the_reference_prompt_character_for_character(mirror: Path, name: str) -> None:
    prompts = load_paper_set(name, mirror)
    assert prompts == EXPECTED[name]
    for got, want in zip(prompts, EXPECTED[name], strict=True):  # Prompt's equality already covers these
        assert got.messages == want.messages and got.followups == want.followups and got.id == want.id
        assert [m["role"] for m in got.messages] == ["user"]  # no system message anywhere


def test_the_default_mirror_reads_the_right_config_split_and_files_in_order(tmp_path: Path) -> None:
    """Decoys sit in the other configs and splits; LiveCodeBench's files are read test.jsonl … test6.jsonl."""
    root = build_mirror(tmp_path, rows_per_set=2)
    for name in PAPER_SET_NAMES:
        prompts = load_paper_set(name, root)
        count = 12 if name == "livecodebench" else 2  # two rows in each of its six files
        assert [p.id for p in prompts] == [f"{name}-{i}" for i in range(count)]
        assert not any("WRONG" in p.messages[0]["content"] for p in prompts), name
    questions = [
        _between(p.messages[0]["content"], "### Question:\n", "\n\n") for p in load_paper_set("livecodebench", root)
    ]
    files = ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"]
    assert questions == [f"{file} Given N, print N + {i}." for file in files for i in range(2)]


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


MARKED_FIELD = {
    "gsm8k": "question",
    "math500": "problem",
    "aime24": "problem",
    "aime25": "problem",
    "humaneval": "prompt",
    "mbpp": "prompt",
    "livecodebench": "question_content",
    "swe-bench": "problem_statement",
    "alpaca": "instruction",
}


def _marked_rows(name: str, count: int) -> list[dict[str, Any]]:
    """`count` rows of the set, row k's prompt text carrying `<row k>`."""
    rows = [SYNTHETIC[name](k) for k in range(count)]
    for k, row in enumerate(rows):
        if name == "mt-bench":
            row["prompt"] = [f"<row {k}> first", f"<row {k}> second"]
        else:
            row[MARKED_FIELD[name]] = f"<row {k}>"
    return rows


def _marks(prompts: list[Prompt]) -> list[int]:
    return [int(re.findall(r"<row (\d+)>", p.messages[0]["content"])[0]) for p in prompts]


@pytest.mark.parametrize("name", PAPER_SET_NAMES)
def test_a_set_of_n_rows_is_taken_whole_in_order(tmp_path: Path, name: str) -> None:
    size = next(s.size for s in PAPER_SETS if s.name == name)
    prompts = load_paper_set(name, build_mirror(tmp_path, rows={name: _marked_rows(name, size)}))
    assert _marks(prompts) == list(range(size))
    assert [p.id for p in prompts] == [f"{name}-{i}" for i in range(size)]


@pytest.mark.parametrize("name", PAPER_SET_NAMES)
def test_a_set_of_n_plus_one_rows_is_shuffled_with_seed_0_and_cut(tmp_path: Path, name: str) -> None:
    """The reference's rule for every set (AIME, HumanEval and MT-Bench are whole only because N is their
    length); the expectation is `datasets`' own shuffle of the rows written, in the order they are read."""
    size = next(s.size for s in PAPER_SETS if s.name == name)
    rows = _marked_rows(name, size + 1)
    prompts = load_paper_set(name, build_mirror(tmp_path, rows={name: rows}))
    field = "prompt" if name == "mt-bench" else MARKED_FIELD[name]
    chosen = datasets.Dataset.from_list(rows).shuffle(seed=0).select(range(size))[field]
    expected = [int(re.findall(r"<row (\d+)>", text if isinstance(text, str) else text[0])[0]) for text in chosen]
    assert _marks(prompts) == expected
    assert expected != list(range(size))  # the shuffle moved something: this test can tell the two apart
    assert [p.id for p in prompts] == [f"{name}-{i}" for i in range(size)]


def test_the_ids_are_stable_and_positions_in_the_chosen_list(tmp_path: Path) -> None:
    rows = _marked_rows("gsm8k", 200)
    root = build_mirror(tmp_path, rows={"gsm8k": rows})
    first = load_paper_set("gsm8k", root)
    paper_datasets._load.cache_clear()
    assert load_paper_set("gsm8k", root) == first  # the same rows under the same ids, read afresh


@pytest.mark.parametrize("name", ["gsm8k", "mt-bench", "livecodebench"])  # a config, a card without one, json
def test_a_mirror_changed_in_place_or_a_second_mirror_is_read_afresh(tmp_path: Path, name: str) -> None:
    """Every read below shares one `datasets` cache, as a user's runs do. `datasets` keys a local folder's
    prepared copy on neither its path nor its files, so each of these was read from the first copy (a sweep
    over a 6-row mirror decoded a 3-row mirror's prompts)."""

    def read(root: Path) -> list[int]:
        paper_datasets._load.cache_clear()  # a new process: only `datasets`' cache is left
        return _marks(load_paper_set(name, root))

    assert read(build_mirror(tmp_path / "a", rows={name: _marked_rows(name, 3)})) == [0, 1, 2]
    assert read(build_mirror(tmp_path / "b", rows={name: _marked_rows(name, 5)})) == [0, 1, 2, 3, 4]  # a second
    in_place = build_mirror(tmp_path / "a", rows={name: _marked_rows(name, 4)})  # downloaded again, newer rows
    assert read(in_place) == [0, 1, 2, 3]
    assert read(tmp_path / "b") == [0, 1, 2, 3, 4]  # unchanged: its own copy, still right


def test_a_missing_mirror_is_one_line_naming_the_repo_and_the_download(tmp_path: Path) -> None:
    with pytest.raises(PromptSetError) as caught:
        load_paper_set("gsm8k", tmp_path)
    assert str(caught.value) == (
        f"gsm8k: openai/gsm8k is not in {tmp_path}; download it with: "
        f"hf download --repo-type dataset openai/gsm8k --local-dir {tmp_path}/openai/gsm8k"
    )


def test_a_mirror_missing_a_livecodebench_file_names_it(tmp_path: Path) -> None:
    root = build_mirror(tmp_path)
    (root / "livecodebench" / "code_generation_lite" / "test4.jsonl").unlink()
    folder = root / "livecodebench" / "code_generation_lite"
    with pytest.raises(PromptSetError) as caught:
        load_paper_set("livecodebench", root)
    assert str(caught.value) == (
        f"livecodebench: {folder} has no test4.jsonl; download it again with: hf download --repo-type dataset "
        f"livecodebench/code_generation_lite --local-dir {folder}"
    )


def test_a_mirror_datasets_cannot_read_is_one_line(tmp_path: Path) -> None:
    root = build_mirror(tmp_path / "gone")
    for shard in (root / "google-research-datasets" / "mbpp" / "sanitized").iterdir():
        shard.unlink()  # the card still names the sanitized config, whose files are gone
    with pytest.raises(PromptSetError) as caught:
        load_paper_set("mbpp", root)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"mbpp: google-research-datasets/mbpp cannot be read from {root}/google-research")
    assert message.endswith(f"--local-dir {root}/google-research-datasets/mbpp")

    root = build_mirror(tmp_path / "mixed", rows={"gsm8k": [{"query": "a column the train split lacks"}]})
    with pytest.raises(PromptSetError) as caught:
        load_paper_set("gsm8k", root)
    assert str(caught.value) == (
        f"gsm8k: openai/gsm8k cannot be read from {root}/openai/gsm8k (CastError: Couldn't cast); "
        f"download it with: hf download --repo-type dataset openai/gsm8k --local-dir {root}/openai/gsm8k"
    )


def test_the_hub_is_read_with_the_reference_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_load(
        path: str, name: str | None = None, *, split: str, data_files: Any = None, cache_dir: str | None = None
    ) -> datasets.Dataset:
        calls.append((path, name, split, data_files, cache_dir))
        if path == "json":
            return datasets.Dataset.from_list([livecodebench_row(0)])
        return datasets.Dataset.from_list([mt_bench_row(0) if path.endswith("mt_bench_prompts") else gsm8k_row(0)])

    downloads: list[tuple[str, str, str, bool]] = []

    def fake_download(repo_id: str, filename: str, *, repo_type: str, local_files_only: bool) -> str:
        downloads.append((repo_id, filename, repo_type, local_files_only))
        return f"/cache/{filename}"

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    load_paper_set("gsm8k", None)
    load_paper_set("mt-bench", None)
    load_paper_set("livecodebench", None)
    files = ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"]
    assert calls == [
        ("openai/gsm8k", "main", "test", None, None),  # the hub's copies: `datasets`' own cache, by revision
        ("HuggingFaceH4/mt_bench_prompts", None, "train", None, None),
        ("json", None, "train", [f"/cache/{file}" for file in files], None),
    ]
    assert downloads == [("livecodebench/code_generation_lite", file, "dataset", False) for file in files]


def test_an_unreachable_hub_is_one_line_naming_the_repo_and_the_download(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(PromptSetError) as caught:
        load_paper_set("gsm8k", None)
    assert str(caught.value) == (
        "gsm8k: openai/gsm8k cannot be read from the Hugging Face hub (ConnectionError: Couldn't reach "
        "'openai/gsm8k' on the Hub (OfflineModeIsEnabled)); download it with: "
        "hf download --repo-type dataset openai/gsm8k --local-dir <datasets folder>/openai/gsm8k"
    )


def test_the_hubs_retries_are_one_line_of_ours_and_its_own_lines_never_reach_the_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hub client logs each failed request (its URL, a name with escape sequences) and each retry on its own
    stderr handler; while a set is read they are held, the first retry said once in our words, and the
    client's logging is as it was afterwards."""
    import logging

    hub = logging.getLogger("huggingface_hub.utils._http")
    seen: list[str] = []  # what the client's own handler (stderr, as the process started) would have printed
    recorder = logging.Handler()
    recorder.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(logging.getLogger("huggingface_hub"), "handlers", [recorder])
    before = logging.getLogger("huggingface_hub").handlers[:]

    def retrying(*args: Any, **kwargs: Any) -> None:
        for attempt in (1, 2):
            hub.warning("'boom' thrown while requesting HEAD https://huggingface.co/\x1b[2Jx/README.md")
            hub.warning(f"Retrying in {attempt}s [Retry {attempt}/5].")
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (ConnectionError)")

    monkeypatch.setattr(datasets, "load_dataset", retrying)
    with pytest.raises(PromptSetError, match=r"^gsm8k: openai/gsm8k cannot be read from the Hugging Face hub"):
        load_paper_set("gsm8k", None)
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "gsm8k: the Hugging Face hub does not answer; retrying for about 30 s (HF_DATASETS_OFFLINE=1 reads the "
        "cache alone; experiment.datasets_dir=<folder> reads a mirror)"
    ]
    assert seen == [] and logging.getLogger("huggingface_hub").handlers == before
    hub.warning("after the read")  # the client's logging as it was
    assert seen == ["after the read"]


MISSING_FIELDS = [
    (
        "aime24",
        [{"id": 1, "query": "no problem here", "answer": "1"}],
        "aime24: row 0 (aime24-0) of HuggingFaceH4/aime_2024 has no text in its field 'problem'",
    ),
    (
        "alpaca",
        [alpaca_row(0), {**alpaca_row(1), "instruction": None}],
        "alpaca: row 1 (alpaca-1) of tatsu-lab/alpaca has no text in its field 'instruction'",
    ),
    (
        "mt-bench",
        [{**mt_bench_row(0), "prompt": []}],
        "mt-bench: row 0 (mt-bench-0) of HuggingFaceH4/mt_bench_prompts has no list of turns in its field 'prompt'",
    ),
]


@pytest.mark.parametrize(("name", "rows", "message"), MISSING_FIELDS)
def test_a_row_without_a_needed_field_is_named(
    tmp_path: Path, name: str, rows: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(PromptSetError) as caught:
        load_paper_set(name, build_mirror(tmp_path, rows={name: rows}))
    assert str(caught.value) == message


def test_a_set_is_read_once_per_process(mirror: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = datasets.load_dataset

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", counted)
    first = resolve_prompts("alpaca", mirror)
    assert resolve_prompts("alpaca", str(mirror)) == first == load_paper_set("alpaca", mirror)
    assert len(calls) == 1
    first.clear()  # a caller's list is its own
    assert load_paper_set("alpaca", mirror) == EXPECTED["alpaca"]


def test_the_named_sets_travel_as_jsonl(mirror: Path) -> None:
    text = prompts_file_text("mt-bench", mirror)
    assert text is not None
    assert parse_prompts(text, "prompts.jsonl") == EXPECTED["mt-bench"]
    assert resolve_prompts("humaneval_completion") == humaneval_prompts()
    assert resolve_prompts("humaneval", mirror) == EXPECTED["humaneval"]
    with pytest.raises(PromptSetError, match="download it with"):
        resolve_prompts("swe-bench", mirror / "elsewhere")


@pytest.mark.parametrize("name", ["gsm8k", "livecodebench"])  # the folder read whole; the files the set names
def test_a_mirror_larger_than_any_paper_set_is_refused_in_one_line_before_it_is_read(tmp_path: Path, name: str) -> None:
    """A sparse file takes no disk and minutes to read: its size as it says it is counted, before `datasets`
    opens anything."""
    root = build_mirror(tmp_path)
    repo = root / next(s.repo for s in PAPER_SETS if s.name == name)
    big = repo / "test6.jsonl" if name == "livecodebench" else sorted(repo.rglob("test-*.parquet"))[0]
    with open(big, "r+b") as f:
        f.truncate(20 << 30)
    paper_datasets._load.cache_clear()
    with pytest.raises(PromptSetError) as refused:
        load_paper_set(name, root)
    assert str(refused.value) == (
        f"{name}: its data files hold 20.0 GiB ({big}: 20.0 GiB), more than any of the paper's sets (at most 16 "
        "GiB): remove what is not the set, or download the repository again"
    )


def test_a_long_first_read_of_a_mirror_is_said_as_it_goes_and_a_prepared_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = build_mirror(tmp_path)
    monkeypatch.setattr(paper_datasets, "PREPARING_FROM_BYTES", 0)  # what a few GiB do, on a mirror of KiB
    monkeypatch.setattr(paper_datasets, "PREPARING_EVERY_S", 0.01)
    ticked = threading.Event()
    real_line, real_load = paper_datasets._Preparing.line, datasets.load_dataset

    def line(self: Any, elapsed_s: float) -> str:
        ticked.set()
        return real_line(self, elapsed_s)

    def long_load(*args: Any, **kwargs: Any) -> Any:
        assert ticked.wait(120), "the progress line never came"  # the read lasts until it has: no timing race
        return real_load(*args, **kwargs)

    monkeypatch.setattr(paper_datasets._Preparing, "line", line)
    monkeypatch.setattr(datasets, "load_dataset", long_load)
    paper_datasets._load.cache_clear()
    load_paper_set("gsm8k", root)
    said = capsys.readouterr().err.splitlines()
    assert re.fullmatch(
        r"gsm8k: preparing \d+ MiB of mirrored data for reading \(once: later reads take the prepared copy in "
        r"/\S+\)",
        said[0],
    )
    assert len(said) >= 2 and all(
        re.fullmatch(r"gsm8k: still preparing \(\d+ s; \d+ MiB written\)", s) for s in said[1:]
    )
    monkeypatch.setattr(datasets, "load_dataset", real_load)
    paper_datasets._load.cache_clear()  # a new process: the prepared copy is there, and nothing is said
    load_paper_set("gsm8k", root)
    assert capsys.readouterr().err == ""
