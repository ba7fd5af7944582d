"""Fixed-shape rounds on the device: the tree equals the host heap's, the walk is the host walk, a round reads
no device value and copies nothing to the device, and the compiled round is one graph compiled once.

Exactness of the fixed rounds' tokens on every model is in the exactness suites (`tests/lossless.py`)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch._dynamo.utils import counters

from bench.op_counts import build
from remote_worker.cache.tree import Tree
from remote_worker.decoding.device_tree import device_best_first_tree, device_chain
from remote_worker.decoding.fixed_prefill import FixedPrefill
from remote_worker.decoding.fixed_round import FixedRound, device_walk
from remote_worker.decoding.loop import decode, decode_from, fixed_capacity, prefill, walk
from remote_worker.decoding.tree_build import best_first_tree, chain_tree
from remote_worker.models.dflash import build_draft
from remote_worker.models.target import TargetModel
from remote_worker.op_count import count_operations
from tests import specs
from tests.tiny_models import model_spec, random_prompt, tiny

# worker: only the worker's dependencies; compat: it touches transformers, so `make test-compat` runs it
# under the oldest supported release too
pytestmark = [pytest.mark.worker, pytest.mark.compat]


def random_logits(case: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Logits of a random shape and budget: plain, or drawn from a few values so that ties are everywhere."""
    rng = random.Random(case)
    depth, vocab, budget = rng.randint(1, 9), rng.choice([2, 3, 7, 16, 64]), rng.choice([1, 2, 3, 5, 8, 16, 32, 64])
    generator = torch.Generator().manual_seed(case)
    if case % 2:
        logits = torch.randint(-3, 3, (depth, vocab), generator=generator).float() * 0.75
    else:
        logits = torch.randn(depth, vocab, generator=generator) * 3
    return logits.to(dtype), budget


def same_tree(device_tree, host_tree) -> bool:
    n = host_tree.tree.size
    return (
        device_tree.tokens[:n].tolist() == host_tree.tree.tokens.tolist()
        and device_tree.parents[:n].tolist() == host_tree.tree.parents.tolist()
        and device_tree.depths[:n].tolist() == host_tree.tree.depths.tolist()
        and device_tree.scores[:n].tolist() == host_tree.scores
        and bool(device_tree.valid[:n].all())
        and not bool(device_tree.valid[n:].any())
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_tree_is_the_host_heaps_tree(dtype: torch.dtype) -> None:
    """Thousands of drafts, half of them full of ties: node for node, score for score, in the heap's order;
    and the scores of float32 or bfloat16 logits are always summed exactly (see `device_tree`)."""
    for case in range(2500):
        logits, budget = random_logits(case, dtype)
        device_tree = device_best_first_tree(torch.tensor(7), logits, budget)
        assert bool(device_tree.exact), case
        assert same_tree(device_tree, best_first_tree(7, logits, budget)), case
        assert device_tree.size == budget + 1


def test_a_float64_tree_differs_from_the_heaps_only_where_it_says_so() -> None:
    """In float64 a score sum can round, and the heap's sibling arithmetic then decides exact ties its own way;
    the device tree must say so (`exact` False) whenever it differs, and that must actually happen here."""
    flagged = 0
    for case in range(400):
        rng = random.Random(case)
        depth, budget = rng.randint(2, 8), rng.choice([8, 32, 64])
        # a few logit values per position: many equal scores, reached through different roundings
        logits = torch.randint(0, 4, (depth, 32), generator=torch.Generator().manual_seed(case)).double() * 0.1
        device_tree = device_best_first_tree(torch.tensor(7), logits, budget)
        flagged += not bool(device_tree.exact)
        if bool(device_tree.exact):
            assert same_tree(device_tree, best_first_tree(7, logits, budget)), case
    assert flagged > 0


def test_the_device_chain_is_dflashs_chain() -> None:
    logits = torch.randint(-2, 2, (7, 16), generator=torch.Generator().manual_seed(0)).float()
    device_tree, host_tree = device_chain(torch.tensor(3), logits, 7), chain_tree(3, logits, 7)
    assert device_tree.tokens.tolist() == host_tree.tree.tokens.tolist()
    assert device_tree.parents.tolist() == host_tree.tree.parents.tolist()


def test_the_device_walk_is_the_host_walk() -> None:
    """Random trees and target choices that follow a random branch for a while: the same path, padded."""
    for case in range(300):
        generator = torch.Generator().manual_seed(case)
        logits = torch.randn(5, 6, generator=generator)
        budget = 1 + case % 24
        host, device = best_first_tree(1, logits, budget), device_best_first_tree(torch.tensor(1), logits, budget)
        node = int(torch.randint(0, host.tree.size, (1,), generator=generator))
        targets = torch.randint(0, 6, (budget + 1,), generator=generator)
        for parent, child in zip(host.tree.path_to(node), host.tree.path_to(node)[1:], strict=False):
            targets[parent] = host.tree.tokens[child]  # the target agrees along the branch to `node`
        expected = walk(host, targets[: host.tree.size].tolist())
        mask = Tree(device.tokens, device.parents, device.depths).ancestor_mask()
        path, count = device_walk(device, targets, mask, 6)
        assert int(count) == len(expected), case
        assert path.tolist() == expected + [expected[-1]] * (6 - len(expected)), case


def meta_pair() -> tuple[TargetModel, object]:
    """A hybrid target (three GDN layers, one attention layer) and its drafter on the `meta` device."""
    target = TargetModel(build("hybrid", "meta", layers=4))
    draft_config = model_spec("tiny_hybrid", "float32").draft.config
    return target, build_draft(dict(draft_config), 0, torch.float32, torch.device("meta"))


@pytest.mark.parametrize("method,budget", [("ar", 0), ("dflash", 0), ("ddtree", 32)])
def test_a_round_reads_nothing_back_and_copies_nothing_to_the_device(method: str, budget: int) -> None:
    """On `meta` any read of a device value fails, and every operation that takes host data is a copy."""
    target, draft = meta_pair()
    rounds = FixedRound(target, method, 256, drafter=None if method == "ar" else draft, budget=budget)
    rounds.step()  # a first round allocates what it caches (rotary tables)
    count = count_operations(rounds.step)
    assert count.scalar_reads == 0
    assert count.host_copies == 0


def test_a_prefill_chunk_reads_nothing_back_and_copies_nothing_to_the_device() -> None:
    target, draft = meta_pair()
    prefiller = FixedPrefill(target, 512, 64, draft.feature_layers)
    prefiller.step()
    count = count_operations(prefiller.step)
    assert count.scalar_reads == 0 and count.host_copies == 0


@pytest.mark.parametrize("name", ["tiny_hybrid", "tiny_qwen3_next"])
def test_a_prefill_in_padded_chunks_commits_what_the_reference_prefill_commits(name: str) -> None:
    """float64, chunks of 5 against the reference's 64: the committed state agrees to float64 rounding (the
    sums run in another order), the lengths exactly, and the decode from it emits AR's tokens."""
    target, draft = tiny(name, "float64")
    prefiller = FixedPrefill(target, 512, 5, draft.feature_layers)
    for seed in (2, 9, 14):  # prompt lengths 6, 13 and 5: a padded last chunk, and one that fills it exactly
        prompt = random_prompt(seed)
        reference, fixed = prefill(target, prompt, draft), prefill(target, prompt, draft, prefiller)
        length = reference.cache.length
        assert fixed.cache.length == length and fixed.draft_context.length == reference.draft_context.length
        for ours, theirs in (
            (fixed.cache.kv[..., :length, :], reference.cache.kv[..., :length, :]),
            (fixed.cache.recurrent, reference.cache.recurrent),
            (fixed.cache.conv, reference.cache.conv),
            (fixed.draft_context.buffer[..., :length, :], reference.draft_context.buffer[..., :length, :]),
        ):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        rounds = FixedRound(target, "ddtree", 512, drafter=draft, budget=8)
        result = decode_from(target, fixed, method="ddtree", max_new_tokens=16, drafter=draft, budget=8, rounds=rounds)
        assert result.tokens == decode(target, prompt, method="ar", max_new_tokens=16).tokens


@pytest.mark.slow
def test_the_compiled_round_is_one_graph_compiled_once() -> None:
    """fullgraph=True makes a graph break an error; the prefill (chunks of 4: prompts of 5 and 6 tokens end
    in a padded chunk) and the round compile once each, and a second prompt compiles nothing again."""
    target, draft = tiny("tiny_hybrid", "float32")
    prompts = [random_prompt(1), random_prompt(2)]
    capacity = fixed_capacity(max(p.shape[0] for p in prompts), 12, draft.block_size, 4)
    rounds = FixedRound(target, "ddtree", capacity, drafter=draft, budget=4)
    prefiller = FixedPrefill(target, 256, 4, draft.feature_layers)
    rounds.compile()
    prefiller.compile()
    torch._dynamo.reset()
    graphs = [counters["stats"]["unique_graphs"]]  # the counter is the process's: other tests may have compiled
    for prompt in prompts:
        start = prefill(target, prompt, draft, prefiller)
        result = decode_from(target, start, method="ddtree", max_new_tokens=12, drafter=draft, budget=4, rounds=rounds)
        assert result.tokens == decode(target, prompt, method="ar", max_new_tokens=12).tokens
        graphs.append(counters["stats"]["unique_graphs"])
    assert [later - graphs[0] for later in graphs[1:]] == [2, 2]


def test_decode_compile_runs_every_method_on_its_fixed_round_and_reports_the_cost(tmp_path, monkeypatch) -> None:
    """The experiment with decode.compile=true: every method decodes with its (warmed-up) fixed-shape round,
    and the job reports compile_s and recompiles. The compiler itself is replaced by the eager round here
    (compiling five rounds takes minutes on a CPU; `test_the_compiled_round_is_one_graph_compiled_once` and
    `make bench` compile for real)."""
    from orchestrator.stream.events import split_events
    from remote_worker.events import EventLog
    from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
    from remote_worker.spec import parse_spec

    used: list[str] = []

    def eager(self: FixedRound, mode: str | None = None) -> None:
        used.append(self.method)

        def counted():
            used.append(f"step {self.method}")
            return self.step()

        self.run = counted

    def eager_prefill(self: FixedPrefill, mode: str | None = None) -> None:
        used.append("prefill")

    monkeypatch.setattr(FixedRound, "compile", eager)
    monkeypatch.setattr(FixedPrefill, "compile", eager_prefill)
    raw = specs.decode_spec(tmp_path, num_prompts=2, model={"device": "cpu"}, max_new_tokens=12, tree_budgets=[4],
                            compile=True)  # fmt: skip
    run_ddtree_gdn(parse_spec(raw, tmp_path), EventLog(tmp_path))
    assert [u for u in used if not u.startswith("step")] == ["prefill", "ar", "dflash", "ddtree"]
    log = split_events((tmp_path / "events.jsonl").read_bytes())[0]
    job = {k: v for e in log if e.kind == "metrics" and e.scope is None for k, v in e.data.items()}
    assert job["recompiles"] == 0 and job["compile_s"] > job["prefill.compile_s"] > 0
    for scope in ("ar", "dflash", "ddtree_tb4"):
        metrics = next(e.data for e in log if e.kind == "metrics" and e.scope == scope and "tau" in e.data)
        params = next(e.data for e in log if e.kind == "params" and e.scope == scope)
        assert metrics["compile_s"] > 0 and metrics["lossless"] == 1.0 and params["compiled"] is True
        assert not any(key.endswith("_ms_per_round") for key in metrics)  # no stage timed apart: no such figure
        assert metrics["inexact_trees"] == 0  # a float32 drafter's scores sum exactly
        # warm-up: two decodes; then 2 prompts; every round of every one went through the compiled entry
        assert used.count(f"step {scope.split('_')[0]}") >= 4
    # The budget answer rests on the rounds the run decoded: its compiled AR and DDTree rounds, timed whole.
    summary = json.loads((tmp_path / "decode_summary.json").read_text())
    assert summary["node_costs"]["kind"] == "compiled" and summary["node_costs"]["sizes"] == [1, 5]
    prediction = summary["prediction"]
    assert prediction["costs_kind"] == prediction["run_kind"] == "compiled"
    assert "its costs are of" not in prediction["line"]
    assert sorted(e.step for e in log if e.kind == "metrics" and "round_cost.round_ms" in e.data) == [1, 5]


def test_a_mixture_of_experts_is_on_the_fast_path() -> None:
    """Qwen3-Next's sparse blocks run in fixed shapes (`models.moe`): nothing refuses to compile them."""
    assert tiny("tiny_qwen3_next")[0].compile_problem() is None
    assert all(mlp.moe is not None for mlp in tiny("tiny_qwen3_next")[0].mlps)
    assert tiny("tiny_hybrid")[0].compile_problem() is None


def test_the_device_hash_is_lowbias32_and_its_draws_are_uniform() -> None:
    """`mix32` (int64 arithmetic that never overflows) against lowbias32 written plainly in Python integers,
    and `counter_uniform`'s draws: in (0, 1), a new set for every counter and seed, uniform by a
    Kolmogorov-Smirnov test."""
    from scipy.stats import kstest

    from remote_worker.decoding.fixed_round import counter_uniform, mix32

    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, *random.Random(5).sample(range(2**32), 500)]
    assert mix32(torch.tensor(values)).tolist() == [lowbias32(v) for v in values]
    draws = [counter_uniform(torch.tensor(s), torch.tensor(c), 33, 61) for s, c in ((7, 0), (7, 1), (8, 0))]
    assert all(bool(((d > 0) & (d < 1)).all()) for d in draws)
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert torch.equal(draws[0], counter_uniform(torch.tensor(7), torch.tensor(0), 33, 61))
    assert kstest(torch.cat([d.flatten() for d in draws]).numpy(), "uniform").pvalue > 1e-4


def test_a_compiled_run_above_temperature_zero_times_its_own_rounds(tmp_path, monkeypatch) -> None:
    """The round-cost slices of a compiled run decode with the rounds the run compiled, at the run's
    temperature (a round compiled for T = 1 refuses a T = 0 decode): the budget answer rests on them."""
    from remote_worker.events import EventLog
    from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
    from remote_worker.spec import parse_spec

    monkeypatch.setattr(FixedRound, "compile", lambda self, mode=None: None)  # the eager step, as compiled
    monkeypatch.setattr(FixedPrefill, "compile", lambda self, mode=None: None)
    raw = specs.decode_spec(tmp_path, num_prompts=2, model={"device": "cpu"}, max_new_tokens=8, tree_budgets=[4],
                            compile=True, temperature=1.0)  # fmt: skip
    run_ddtree_gdn(parse_spec(raw, tmp_path), EventLog(tmp_path))
    summary = json.loads((tmp_path / "decode_summary.json").read_text())
    assert summary["node_costs"]["kind"] == "compiled" and summary["node_costs"]["sizes"] == [1, 5]
    assert summary["prediction"]["run_kind"] == "compiled"
