"""Records of a decode: a multi-turn conversation decoded turn by turn from one shared history, and a prompt
set split into shards that decode exactly the records the whole set would (tokens equal, at T = 1 too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn, shard_of
from remote_worker.experiments.record_loop import TURN_INDEX_STRIDE
from remote_worker.prompt_set import Prompt, PromptSetError, parse_prompts
from remote_worker.spec import parse_spec
from tests.specs import decode_spec

pytestmark = pytest.mark.worker

CONVERSATIONS = [
    {"id": "a", "messages": [{"role": "user", "content": "def add(a, b):"}]},
    {"id": "b", "messages": [{"role": "user", "content": "Name three colours."}], "followups": ["And three more?"]},
    {"id": "c", "messages": [{"role": "user", "content": "for i in range(10):"}]},
]


def decode(tmp_path: Path, name: str, shard: str | None, temperature: float) -> list[dict]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "prompts.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    raw = decode_spec(
        run_dir, num_prompts=None, max_new_tokens=6, tree_budgets=[4], temperature=temperature, node_costs=False,
        compile=False,
    )  # fmt: skip
    raw["experiment"].update(prompts_file="prompts.jsonl", shard=shard)
    run_ddtree_gdn(parse_spec(raw, run_dir), EventLog(run_dir))
    return [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shards_decode_the_records_of_the_whole_set(tmp_path: Path, temperature: float) -> None:
    whole = decode(tmp_path, "whole", None, temperature)
    shards = decode(tmp_path, "s0", "0/2", temperature) + decode(tmp_path, "s1", "1/2", temperature)
    assert [r["id"] for r in whole] == ["a", "b", "b#2", "c"]
    assert sorted(r["id"] for r in shards) == ["a", "b", "b#2", "c"]
    assert [r["index"] for r in whole] == [0, 1, 1 + TURN_INDEX_STRIDE, 2]  # each record's seed, in any shard
    by_id = {r["id"]: r for r in shards}
    for row in whole:
        other = by_id[row["id"]]
        assert other["index"] == row["index"] and other["prompt"] == row["prompt"]
        assert {s: m["tokens"] for s, m in other["methods"].items()} == {
            s: m["tokens"] for s, m in row["methods"].items()
        }


def test_turn_two_continues_the_last_methods_answer_for_every_method(tmp_path: Path) -> None:
    rows = {r["id"]: r for r in decode(tmp_path, "turns", None, 1.0)}
    first, second = rows["b"], rows["b#2"]
    assert first["turn"] == 1 and second["turn"] == 2
    answer = first["methods"]["ddtree_tb4"]["text"]  # the last method's (special tokens skipped; bytes here)
    expected = f"<user>Name three colours.\n<assistant>{answer}\n<user>And three more?\n<assistant>"
    assert second["prompt"] == expected
    assert set(second["methods"]) == {"ar", "dflash", "ddtree_tb4"}  # every method from that same history


def test_a_conversations_turns_and_its_file_form() -> None:
    prompt = parse_prompts(json.dumps(CONVERSATIONS[1]) + "\n", "x.jsonl")[0]
    assert prompt.turns == 2 and prompt.turn_id(2) == "b#2" and prompt.as_record() == CONVERSATIONS[1]
    nxt = prompt.next_turn("red, green, blue")
    assert nxt.messages[1:] == [
        {"role": "assistant", "content": "red, green, blue"},
        {"role": "user", "content": "And three more?"},
    ]
    assert nxt.followups == ()
    with pytest.raises(ValueError, match="no further turn"):
        nxt.next_turn("x")
    assert Prompt("p", [{"role": "user", "content": "x"}]).as_record() == {
        "id": "p",
        "messages": [{"role": "user", "content": "x"}],
    }
    for bad in ('"followups": "x"', '"followups": [1]'):
        with pytest.raises(PromptSetError, match="followups"):
            parse_prompts('{"id": "p", "messages": [{"role": "user", "content": "x"}], ' + bad + "}\n", "x.jsonl")


def test_a_shard_is_i_of_n() -> None:
    assert shard_of(None) == (0, 1) and shard_of("1/8") == (1, 8)
    for bad in ("8/8", "-1/2", "1/0"):
        with pytest.raises(ValueError):
            shard_of(bad)
