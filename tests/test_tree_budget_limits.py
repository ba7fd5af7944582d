"""A tree budget the model cannot hold: refused before launch where the config says so (context, draft
block × vocabulary), else on the worker before the first prompt (the draft block, the device's memory)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from orchestrator.config.validation import ConfigError
from remote_worker.decoding.tree_limits import beyond_draft, distinct_nodes
from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
from remote_worker.spec import parse_spec
from tests.conftest import run_orchestrator
from tests.specs import decode_spec
from tests.test_validation import composed

GIB = 1 << 30


def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        composed(overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_the_issues_budget_stops_the_cli_before_anything_is_created(tmp_path: Path) -> None:
    """`decode.tree_budgets=[100000]` on the default model (the trained fixture: 2048 positions)."""
    store = tmp_path / "mlruns.db"
    result = run_orchestrator(["decode.tree_budgets=[100000]", f"tracking.uri=sqlite:///{store}"], cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "config error: decode.tree_budgets: budget 100000 needs 100001 positions for its tree beside "
        "decode.max_new_tokens=64 and the longest prompt ('heldout-zipimport-0', 160 tokens), more than model "
        "tiny_trained's context of 2048; the largest budget that fits is 1823"
    ]
    assert not store.exists()


def test_the_largest_budget_named_is_the_largest_that_passes() -> None:
    """tiny_hybrid's inline config: 2048 positions = the longest default prompt (153 bytes: a model without a
    tokenizer reads bytes) + 1800 new tokens + 94 + 1 tree nodes."""
    base = ["model=tiny_hybrid", "decode.max_new_tokens=1800"]
    composed([*base, "decode.tree_budgets=[16,94]"])
    assert refusal([*base, "decode.tree_budgets=[16,95]"]) == (
        "decode.tree_budgets: budget 95 needs 96 positions for its tree beside decode.max_new_tokens=1800 and the "
        "longest prompt ('multi-turn', 153 tokens), more than model tiny_hybrid's context of 2048; the largest "
        "budget that fits is 94"
    )
    # 2048 positions = 153 + the new tokens + a draft block of 8 (tiny_hybrid's draft) at the last round
    assert refusal(["model=tiny_hybrid", "decode.max_new_tokens=1900"]).endswith(
        "; lower decode.max_new_tokens to at most 1887"
    )


def test_a_prompt_longer_than_the_context_is_told_to_be_shortened_not_the_new_tokens(tmp_path: Path) -> None:
    """A 1 MB prompt (a byte-level model: a million tokens) cannot fit whatever decode.max_new_tokens is: the
    refusal names the prompt's file and line and says to shorten it or leave it out."""
    prompts = tmp_path / "huge.jsonl"
    small = {"id": "small", "messages": [{"role": "user", "content": "def f():"}]}
    huge = {"id": "huge", "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    prompts.write_text(json.dumps(small) + "\n" + json.dumps(huge) + "\n")
    message = refusal(["model=tiny_hybrid", f"experiment.prompts={prompts}", "decode.max_new_tokens=8"])
    assert message.startswith("decode.tree_budgets: budget 64 needs 65 positions for its tree beside ")
    assert "the longest prompt ('huge', 1048" in message and "more than model tiny_hybrid's context of 2048" in message
    assert message.endswith(
        f"; that prompt alone does not fit: shorten it or leave it out of the prompt set ({prompts}:2)"
    )
    assert "max_new_tokens to" not in message


def test_a_budget_a_draft_block_cannot_fill_is_refused() -> None:
    """With one drafted position (decode.block_size=2) the tree's nodes are the vocabulary's 260 tokens at
    depth 1: a budget of 261 would be a padded tree in a run named ddtree_tb261."""
    base = ["model=tiny_trained", "decode.block_size=2"]
    composed([*base, "decode.tree_budgets=[260]"])
    assert refusal([*base, "decode.tree_budgets=[261]"]) == (
        "decode.tree_budgets: budget 261 is more nodes than a draft block of 2 can offer (1 drafted position "
        "over a vocabulary of 260: 260 distinct nodes); lower the budget or raise decode.block_size"
    )
    composed(["model=tiny_trained", "decode.block_size=3", "decode.tree_budgets=[1000]"])  # 260 + 260² nodes


def test_the_draft_bound_counts_every_path_not_depths_times_vocabulary() -> None:
    """The same token can sit at one depth under many parents: Σ vocab^d nodes, not (block_size-1) × vocab."""
    assert distinct_nodes(1, 260) == 260
    assert distinct_nodes(2, 3) == 3 + 9
    assert distinct_nodes(15, 248_320) == 1 << 62  # capped, not a 81-digit integer
    assert beyond_draft(12, 3, 3) is None
    assert beyond_draft(13, 3, 3) is not None and "12 distinct nodes" in beyond_draft(13, 3, 3)


def test_a_checkpoint_on_this_machine_is_read_and_a_remote_one_left_to_the_worker(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(
        json.dumps({"text_config": {"vocab_size": 99, "max_position_embeddings": 512}})
    )
    local = ["model=tiny_trained", f"model.path={checkpoint}", "decode.tree_budgets=[500]"]
    assert "model tiny_trained's context of 512; the largest budget that fits is 446" in refusal(local)
    # On an SSH host the same path is the host's: out of reach here, so the worker checks it there.
    composed(["host=kpro5", "model=tiny_trained", f"model.path={checkpoint}", "decode.tree_budgets=[500]"])
    composed(["attach=last", "decode.tree_budgets=[100000]"])  # attaching launches nothing


def worker_spec(run_dir: Path, **decode: object) -> dict:
    return decode_spec(run_dir, num_prompts=1, model={"device": "cpu"}, max_new_tokens=4, **decode)


def test_the_worker_refuses_a_budget_its_draft_block_cannot_fill(tmp_path: Path) -> None:
    """A checkpoint on a remote host: the same line, from the loaded model, before the first prompt."""
    spec = parse_spec(worker_spec(tmp_path, block_size=2, tree_budgets=[16, 600]), tmp_path)
    with pytest.raises(ValueError) as err:
        run_ddtree_gdn(spec, EventLog(tmp_path))
    assert str(err.value) == (
        "decode.tree_budgets: budget 600 is more nodes than a draft block of 2 can offer (1 drafted position "
        "over a vocabulary of 512: 512 distinct nodes); lower the budget or raise decode.block_size"
    )


def test_the_worker_says_what_an_absurd_budget_needs_against_this_machines_memory(tmp_path: Path) -> None:
    """A context long enough for a million-node tree, so only memory can refuse it: the line's figure is the
    arithmetic of tiny_hybrid's shapes (float32, 3 GDN layers of 2 key / 4 value heads of 16, conv kernel 4,
    one attention layer of 4 query / 2 KV heads of 16, vocabulary 512), compared with the available RAM."""
    raw = worker_spec(tmp_path, tree_budgets=[1_000_000])
    raw["model"]["config"]["max_position_embeddings"] = 10_000_000
    with pytest.raises(ValueError) as err:
        run_ddtree_gdn(parse_spec(raw, tmp_path), EventLog(tmp_path))
    line = str(err.value)
    match = re.fullmatch(
        r"decode\.tree_budgets: budget 1000000 needs at least ([\d.]+) GiB for one tree at (\d+) tokens of context "
        r"\(tree masks ([\d.]+), tree K/V [\d.]+, GDN states kept for the commit [\d.]+, one GDN layer's scratch "
        r"([\d.]+) GiB\), more than the ([\d.]+) GiB free on cpu; the largest budget that fits is (\d+)",
        line,
    )
    assert match is not None, line
    need, context, masks, scratch, free, largest = match.groups()
    n, c, f32 = 1_000_001, int(context), 4
    expected_masks = n * n * (1 + 2 * f32) + n * (c + n) * f32  # ancestor mask (bool, 0/1, log) + attention bias
    expected_scratch = 2 * 4 * n * n * f32  # one GDN layer's decay and system, [Hv, n, n]
    conv_dim = 2 * 2 * 16 + 4 * 16
    kept = 3 * (n * (2 * 16 + 4 * 16) * f32 + (3 + n) * conv_dim * f32)
    kv = 2 * 2 * n * 16 * f32
    assert masks == f"{expected_masks / GIB:.1f}" and scratch == f"{expected_scratch / GIB:.1f}"
    assert need == f"{(expected_masks + kv + kept + expected_scratch) / GIB:.1f}"
    assert float(need) > float(free) > 0
    # The largest budget named fits what was free by the same count (n² terms: about √(free / 45 bytes)).
    assert 0 < int(largest) < math.isqrt(int(float(free) * GIB) // 40)
