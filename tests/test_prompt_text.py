"""Prompts survive any text: the file the orchestrator writes is read back by the worker's own parser as the very
same records, whatever characters a dataset holds; what no tokenizer can take is named by dataset, row and
column before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.config.paper_datasets import PAPER_SET_NAMES
from orchestrator.config.prompts import prompts_file_text, resolve_prompts
from orchestrator.config.validation import ConfigError
from remote_worker.prompt_set import Prompt, PromptSetError, load_prompt_file, parse_prompts, round_trip, to_jsonl
from tests.paper_mirror import ODD_TEXT, build_mirror
from tests.test_validation import composed

pytestmark = pytest.mark.usefixtures("datasets_cache")  # tests/conftest.py: a cache of their own, read afresh

# Every character `str.splitlines` breaks a line on, and the other kinds of text a hub dataset holds.
LINE_BREAKERS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
OTHER_TEXT = "\x00 \ufeff \u200b \u202e\u202c e\u0301 中文 🧪 \t {x} {{}} \\ \" '"


def odd_prompts() -> list[Prompt]:
    """One record a character, and one with all of them in every field."""
    every = LINE_BREAKERS + OTHER_TEXT
    each = [Prompt(f"char-{ord(ch):04x}", [{"role": "user", "content": f"a{ch}b"}]) for ch in sorted(set(every))]
    everywhere = [{"role": "system", "content": every}, {"role": "user", "content": every}]
    return [*each, Prompt("all", everywhere, followups=(every,))]


def test_the_written_file_reads_back_as_the_same_records_and_is_plain_ascii() -> None:
    prompts = odd_prompts()
    text = round_trip(prompts, "test")
    assert text.isascii() and text.count("\n") == len(prompts) and text.splitlines() == text.split("\n")[:-1]
    assert parse_prompts(text, "test") == prompts
    assert [p.as_record() for p in parse_prompts(text, "test")] == [p.as_record() for p in prompts]


def test_a_users_file_is_split_on_newline_only(tmp_path: Path) -> None:
    """A file written with ensure_ascii=False (raw U+2028, U+0085, form feeds in its strings), with CRLF line ends
    and a BOM, reads as its records: JSON holds no raw newline, so `\\n` alone ends a line."""
    prompts = odd_prompts()
    raw = "\ufeff" + "".join(json.dumps(p.as_record(), ensure_ascii=False) + "\r\n" for p in prompts) + "\r\n"
    path = tmp_path / "mine.jsonl"
    path.write_bytes(raw.encode("utf-8"))
    assert load_prompt_file(path) == prompts
    assert [p.line for p in load_prompt_file(path)] == list(range(1, len(prompts) + 1))


def test_a_lone_surrogate_is_named_by_its_line() -> None:
    text = to_jsonl([Prompt("fine", [{"role": "user", "content": "x"}])]) + '{"id": "bad", "messages": ' \
        '[{"role": "user", "content": "a\\ud800b"}]}\n'  # fmt: skip
    with pytest.raises(PromptSetError) as err:
        parse_prompts(text, "mine.jsonl")
    assert str(err.value) == (
        "mine.jsonl:2: not a prompt line (a message's content holds a lone surrogate U+D800 at character 1, "
        "which has no UTF-8 form)"
    )
    with pytest.raises(PromptSetError, match=r"^x:1: not a prompt line \(a followup holds a lone surrogate U\+DC80"):
        parse_prompts(json.dumps({"messages": [{"role": "user", "content": "a"}], "followups": ["\udc80"]}), "x")


@pytest.fixture(scope="module")
def odd_mirror(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mirror(tmp_path_factory.mktemp("odd-datasets"), rows_per_set=2, odd=True)


@pytest.mark.parametrize("name", PAPER_SET_NAMES)
def test_every_paper_set_keeps_odd_text_to_the_worker(odd_mirror: Path, name: str) -> None:
    """Each prompt column of every set carries every separator: the prompt file holds them all, and the worker's
    reader gives back exactly the prompts the orchestrator built."""
    prompts = resolve_prompts(name, odd_mirror)
    assert prompts and all(ODD_TEXT in p.messages[0]["content"] for p in prompts)
    assert all(ODD_TEXT in turn for p in prompts for turn in p.followups)
    text = prompts_file_text(name, odd_mirror)
    assert text is not None and parse_prompts(text, "run") == prompts
    composed([f"experiment.prompts={name}", f"experiment.datasets_dir={odd_mirror}"])  # the config check passes


def _invalid_utf8_parquet(path: Path, column: str, good: str) -> None:
    """A parquet shard whose second row's `column` holds a UTF-16 surrogate encoded in UTF-8 (CESU-8 bytes, as
    some exporters write), which Arrow stores unchecked and Python cannot decode."""
    values = [good.encode(), b"ok \xed\xa0\x80 x"]
    offsets = [0, len(values[0]), len(values[0]) + len(values[1])]
    array = pa.Array.from_buffers(
        pa.string(), 2, [None, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]), pa.py_buffer(b"".join(values))]
    )
    pq.write_table(pa.table({column: array, "answer": ["1", "2"]}), path)


def test_undecodable_text_in_a_parquet_is_named_by_dataset_row_and_column(tmp_path: Path) -> None:
    root = build_mirror(tmp_path / "datasets")
    shard = root / "openai" / "gsm8k" / "main" / "test-00000-of-00001.parquet"
    _invalid_utf8_parquet(shard, "question", "fine")
    with pytest.raises(ConfigError) as err:
        composed(["experiment.prompts=gsm8k", f"experiment.datasets_dir={root}"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("experiment.prompts: gsm8k: row 1 (gsm8k-1) of openai/gsm8k ")
    assert "'question'" in message and "UTF-8" in message


def test_a_lone_surrogate_in_a_json_dataset_is_one_line_naming_the_set_and_row(tmp_path: Path) -> None:
    """Arrow's JSON reader refuses the file itself (the reference benchmark could not read it either): one line
    naming the set, the row and the fix, never a traceback."""
    root = build_mirror(tmp_path / "datasets")
    rows = [{"problem": "fine", "answer": "1"}, {"problem": "a \ud800 b", "answer": "2"}]
    (root / "HuggingFaceH4" / "MATH-500" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as err:
        composed(["experiment.prompts=math500", f"experiment.datasets_dir={root}"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("experiment.prompts: math500: HuggingFaceH4/MATH-500 cannot be read from ")
    assert "surrogate" in message and "row 1" in message and "hf download" in message
