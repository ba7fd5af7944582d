"""`ddtree_online` on the compiled path (`decoding/online_round.py`): one draft graph of the largest tree, one
verify graph per captured size, the size of each round the policy's choice among them. Whatever size a round
verifies, its tokens are AR's at T = 0; no size outside the captured ones is ever verified; no graph is compiled
during a decode; a compiled run reports the method as every other."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from remote_worker.decoding.device_tree import device_best_first_tree
from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import decode, decode_from, fixed_capacity, prefill
from remote_worker.decoding.online_budget import OnlineBudget
from remote_worker.decoding.online_round import TIMED_WARMUP_ROUNDS, OnlineRound
from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
from remote_worker.spec import parse_spec
from tests.specs import decode_spec
from tests.tiny_models import random_prompt, tiny


def forced(round_: OnlineRound, sizes: list[int]) -> list[int]:
    """Make the round's policy choose `sizes` in turn (every captured size, whatever the drafter's numbers),
    skipping those past the tree grown this round, keeping the real choice's bookkeeping; returns the list of
    what it chose."""
    cycle, chosen = itertools.cycle(sizes), []
    real = round_.policy.choose_tree

    def choose(scores, parents, depths) -> int:
        real(scores, parents, depths)
        chosen.append(next(n for n in cycle if n < len(scores)))
        return chosen[-1]

    round_.policy.choose_tree = choose  # type: ignore[method-assign]
    return chosen


def test_a_device_trees_prefix_is_the_device_tree_of_the_smaller_budget() -> None:
    for seed in range(6):
        logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(seed)) * (1 + seed)
        large = device_best_first_tree(torch.tensor(3), logits, 40)
        for budget in (1, 6, 17, 39):
            small, cut = device_best_first_tree(torch.tensor(3), logits, budget), large.prefix(budget)
            for name in ("tokens", "parents", "depths", "valid", "scores", "ranks"):
                assert torch.equal(getattr(cut, name), getattr(small, name)), (seed, budget, name)
    with pytest.raises(ValueError, match="prefix of budget 41"):
        large.prefix(41)


@pytest.mark.parametrize("name", ["tiny_hybrid", "tiny_dense"])
def test_every_captured_size_emits_ar_tokens_and_no_other_size_is_verified(name: str) -> None:
    """The eager round (the graphs' own Python): rounds forced through every size in turn, then the policy's
    own choices once the warm-up has priced each size, emit AR's tokens; every round verified a captured size."""
    target, draft = tiny(name, "float32")
    policy = OnlineBudget.for_budgets([2, 4, 8]).captured()
    assert policy.sizes == (2, 4, 8)
    prompts = [random_prompt(seed) for seed in range(3)]
    rounds = OnlineRound(target, fixed_capacity(max(len(p) for p in prompts), 20, draft.block_size, 8),
                         drafter=draft, policy=policy)  # fmt: skip
    start = prefill(target, prompts[0], draft)
    rounds.warm_every_size(lambda attempt: rounds.reset(start.cache, start.draft_context, start.root, None))
    for n in (2, 4, 8):
        assert len(rounds.draft_times[n]) == len(rounds.verify_times[n]) == TIMED_WARMUP_ROUNDS
        assert policy.cost_ms is not None and policy.cost_ms(n) > rounds.verify_times[n].median > 0
    assert policy.calibration.rounds == 0 and not policy.verified  # costs, no history
    sizes = []
    for index, prompt in enumerate(prompts):
        chosen = forced(rounds, [8, 2, 4]) if index == 0 else []
        result = decode_from(target, prefill(target, prompt, draft), method="ddtree", max_new_tokens=20,
                             drafter=draft, budget=8, rounds=rounds)  # fmt: skip
        assert result.tokens == decode(target, prompt, method="ar", max_new_tokens=20).tokens
        if chosen:
            assert result.tree_sizes == [n + 1 for n in chosen] and set(chosen) == {2, 4, 8}
            del rounds.policy.choose_tree  # the real choice from here on
        sizes += result.tree_sizes
    assert set(sizes) <= {3, 5, 9} and sum(policy.verified.values()) == len(sizes) == policy.calibration.rounds
    assert policy.ready and all(len(rounds.verify_times[n]) > TIMED_WARMUP_ROUNDS for n in policy.verified)
    assert len(rounds.draft_times[4]) > TIMED_WARMUP_ROUNDS  # after a round of 2, the tree grew to 4, not to 8


def test_a_size_the_policy_was_not_given_is_refused() -> None:
    target, draft = tiny("tiny_hybrid", "float32")
    rounds = OnlineRound(target, 256, drafter=draft, policy=OnlineBudget(8, (2, 8), 2))
    rounds.policy.choose_tree = lambda *tree: 4  # type: ignore[method-assign]
    start = prefill(target, random_prompt(1), draft)
    rounds.reset(start.cache, start.draft_context, start.root, None)
    with pytest.raises(AssertionError, match=r"chose 4 of a tree of 2, captured sizes \(2, 8\)"):
        rounds.run()
    rounds.policy.choose_tree = lambda *tree: 8  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match=r"chose 8 of a tree of 2"):
        rounds.run()  # a captured size, but more than this round's tree holds


@pytest.mark.slow
def test_the_compiled_online_round_compiles_every_size_before_the_decodes_and_none_during_them() -> None:
    """Compiled for real (inductor on the CPU; fullgraph, so a break is an error): the draft graph and one verify
    graph per size, all compiled and run by the warm-up; the decodes, rounds forced through both sizes in turn,
    compile nothing and emit AR's tokens."""
    torch._dynamo.reset()
    target, draft = tiny("tiny_hybrid", "float32")
    prompts = [random_prompt(4), random_prompt(11)]
    policy = OnlineBudget.for_budgets([2, 4]).captured()
    rounds = OnlineRound(target, fixed_capacity(max(len(p) for p in prompts), 12, draft.block_size, 4),
                         drafter=draft, policy=policy)  # fmt: skip
    rounds.compile()
    start = prefill(target, prompts[0], draft)
    rounds.warm_every_size(lambda attempt: rounds.reset(start.cache, start.draft_context, start.root, None))
    graphs = counters["stats"]["unique_graphs"]
    chosen = forced(rounds, [2, 4])
    for prompt in prompts:
        result = decode_from(target, prefill(target, prompt, draft), method="ddtree", max_new_tokens=12,
                             drafter=draft, budget=4, rounds=rounds)  # fmt: skip
        assert result.tokens == decode(target, prompt, method="ar", max_new_tokens=12).tokens
    assert set(chosen) == {2, 4} and counters["stats"]["unique_graphs"] == graphs


@pytest.mark.worker
def test_a_compiled_run_decodes_ddtree_online_on_its_captured_sizes(tmp_path: Path, monkeypatch) -> None:
    """`decode.compile=true` with `decode.online_budget=true`: `ddtree_online` decodes on its own fixed-shape
    round (the compiler replaced by the eager rounds, as in `test_fixed_round`), exact at T = 0, verifying only
    the run's budgets, priced by its own measured rounds; the fixed rounds' timings leave it out (its rounds
    have no one size)."""
    built: list[str] = []

    def eager(self: FixedRound, mode: str | None = None) -> None:
        built.append(type(self).__name__)

    monkeypatch.setattr(FixedRound, "compile", eager)
    monkeypatch.setattr(OnlineRound, "compile", eager)
    monkeypatch.setattr("remote_worker.decoding.fixed_prefill.FixedPrefill.compile", lambda self, mode=None: None)
    raw = decode_spec(tmp_path, num_prompts=2, model={"device": "cpu"}, max_new_tokens=16, tree_budgets=[2, 8],
                      compile=True, online_budget=True, node_cost_repeats=1)  # fmt: skip
    run_ddtree_gdn(parse_spec(raw, tmp_path), EventLog(tmp_path))
    assert built.count("OnlineRound") == 1 and built.count("FixedRound") == 4  # ar, dflash, tb2, tb8
    summary = json.loads((tmp_path / "decode_summary.json").read_text())
    online = next(m for m in summary["methods"] if m["scope"] == "ddtree_online")
    assert online["lossless"] == 1.0
    record = summary["online_budget"]["ddtree_online"]
    assert record["sizes"] == [2, 8] and record["costs"] is True
    rounds = {int(n): count for n, count in record["rounds_at_budget"].items()}
    assert set(rounds) <= {2, 8} and sum(rounds.values()) >= 2
    assert summary["node_costs"]["kind"] == "compiled" and summary["node_costs"]["sizes"] == [1, 3, 9]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    params = next(e["data"] for e in events if e["kind"] == "params" and e.get("scope") == "ddtree_online")
    assert params["compiled"] is True


def test_padding_has_no_chance_of_acceptance() -> None:
    """A fixed-shape tree pads with score -inf where the candidates ran out; its padding hangs off the root, in
    the bin of guesses near 0, which a run may have seen accepted. Its chance is 0 all the same: at equal costs
    the smaller size, all of whose real nodes it holds, is chosen."""
    policy = OnlineBudget(4, (2, 4), 2)
    for _ in range(4):  # steps guessed near 0 at depth 1, every one accepted: the bin's share is high
        policy.calibration.observe([0.01] * 10, [1] * 10, [True] * 10)
    policy.priced(lambda n: 1.0, lambda nodes: 0.0)
    scores, parents, depths = [0.0, -0.1, -0.2, -math.inf, -math.inf], [-1, 0, 1, 0, 0], [0, 1, 2, 1, 1]
    assert policy.choose_tree(scores, parents, depths) == 2
    assert policy.choose_tree([0.0, -0.1, -0.2, -3.0, -3.1], parents, depths) == 4  # real guesses of 0.05: worth it
