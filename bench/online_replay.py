"""What a per-round budget could gain at all, and what `ddtree_online`'s policy takes of it, without timing noise.

Each record is decoded once with DDTree at the largest budget B; every round keeps its whole grown tree and
the accepted path. By the prefix property (`tree_build`) the round at any budget n <= B verifies the first n
nodes of that tree and, at temperature 0, accepts exactly the path's nodes numbered <= n (its leading ones: a
path's nodes increase). So one decode tells, for every round, what each budget would have committed from that
round's state; costs come from the host's node-cost probe (`NodeCosts`: a fixed budget's round at b, an online
round's at n with its tree grown to B). Replayed on those rounds (a state a smaller budget would have reached
otherwise is taken as this one: the replay is a model, not a decode):

- `fixed`: every budget of the sizes, and the best of them after the fact (what the grid reports);
- `oracle`: the best any per-round choice among the sizes could do on these rounds, knowing each round's
  outcome and so growing its tree exactly as far as it verifies (tokens over time maximized over the whole
  run: per round the n of most tokens − λ · ms, λ the run's rate, iterated to its fixed point);
- `raw`: the policy on the drafter's own guesses, uncalibrated;
- `online`: `OnlineBudget` as a decode runs it, each round's tree grown as far as it says (`grow_to`), its
  calibration learned round by round from what the chosen tree showed.

At T > 0 a round's path was sampled at B; a smaller tree would have drawn other samples, so there the replay
is an estimate of the same expectation, not the same draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from remote_worker.decoding.loop import DraftTree, decode_from, prefill
from remote_worker.decoding.node_cost import NodeCosts
from remote_worker.decoding.online_budget import PRIOR, Calibration, OnlineBudget
from remote_worker.decoding.tree_build import Growth


@dataclass(frozen=True)
class ReplayRound:
    grown: Growth  # the whole tree at the largest budget
    path: list[int]  # the accepted path through it (node numbers, the root first)

    def accepted(self, budget: int) -> int:
        """Drafted tokens a round of `budget` would have accepted from this state (the path's nodes <= budget)."""
        count = 0
        for node in self.path[1:]:
            if node > budget:
                break
            count += 1
        return count


class _Recorder:
    """A stand-in policy for `decode_from(online=…)`: verifies the whole tree and keeps every round."""

    def __init__(self) -> None:
        self.rounds: list[ReplayRound] = []
        self._grown: Growth | None = None

    def grow_to(self) -> int:
        return 1 << 30  # as far as the decode's budget

    def choose(self, grown: Growth) -> int:
        self._grown = grown
        return grown.nodes

    def observe(self, draft: DraftTree, path: list[int]) -> None:
        assert self._grown is not None
        self.rounds.append(ReplayRound(self._grown, list(path)))


def record_rounds(
    target: Any, drafter: Any, prompts: Sequence[torch.Tensor], largest: int, temperature: float, new_tokens: int
) -> list[ReplayRound]:
    """Every round of a DDTree decode at `largest` over `prompts` (seeded per prompt at T > 0)."""
    recorder = _Recorder()
    for index, ids in enumerate(prompts):
        start = prefill(target, ids, drafter)
        generator = torch.Generator(device=target.device).manual_seed(index)
        decode_from(target, start, method="ddtree", budget=largest, drafter=drafter, max_new_tokens=new_tokens,
                    temperature=temperature, generator=generator, online=recorder)  # type: ignore[arg-type]  # fmt: skip
    return recorder.rounds


def _rate(rounds: Sequence[ReplayRound], chosen: Sequence[int], cost: Callable[[int], float]) -> float:
    """Tokens per millisecond of the rounds at the chosen budgets."""
    return sum(r.accepted(n) + 1 for r, n in zip(rounds, chosen, strict=True)) / sum(cost(n) for n in chosen)


def _oracle(rounds: Sequence[ReplayRound], sizes: Sequence[int], cost: Callable[[int], float]) -> float:
    rate = 0.0
    for _ in range(100):  # Dinkelbach: converges in a few steps; stops at the fixed point
        chosen = [max(sizes, key=lambda n, r=r: r.accepted(n) + 1 - rate * cost(n)) for r in rounds]
        new = _rate(rounds, chosen, cost)
        if new <= rate * (1 + 1e-12):
            break
        rate = new
    return rate


class _Uncalibrated(Calibration):
    def calibrated(self, q: float, depth: int) -> float:
        return q


def _policy(rounds: Sequence[ReplayRound], policy: OnlineBudget, naive: bool = False) -> float:
    """The policy run over the rounds as a decode runs it (each round's tree grown as far as it says, the
    choice, then what the verified tree showed): its tokens per millisecond."""
    tokens = ms = 0.0
    for r in rounds:
        grown = r.grown.prefix(policy.grow_to())
        n = policy.choose_naive(grown) if naive else policy.choose(grown)
        tokens += r.accepted(n) + 1
        ms += policy._round_ms(n, grown.nodes)
        policy.observe(r.grown.first(n), [node for node in r.path if node <= n])
    return tokens / ms


def replay(rounds: Sequence[ReplayRound], budgets: Sequence[int], costs: NodeCosts) -> dict[str, Any]:
    """The replay's figures on one job's rounds (see the module): tokens/ms of each, and each over the best
    fixed budget."""
    online = OnlineBudget.for_budgets(budgets)
    sizes = online.sizes
    fixed = {n: _rate(rounds, [n] * len(rounds), costs.round_ms) for n in sizes}
    best = max(fixed, key=lambda n: fixed[n])
    online.measured(costs)
    raw_policy = OnlineBudget(online.largest, sizes, online.fixed, calibration=_Uncalibrated())
    raw_policy.measured(costs)
    figures = {
        "oracle": _oracle(rounds, sizes, costs.round_ms),  # each round's tree grown to what it verifies
        "raw": _policy(rounds, raw_policy, naive=True),  # the naive choice reads `calibrated`: the guess itself
        "online": _policy(rounds, online),
    }
    return {
        "rounds": len(rounds),
        "best_fixed": best,
        "fixed_vs_best": {str(n): fixed[n] / fixed[best] for n in sizes},
        **{f"{name}_vs_best": value / fixed[best] for name, value in figures.items()},
        "prior": PRIOR,
        "calibration": online.calibration.as_record(),
        "chosen": {str(n): count for n, count in sorted(online.verified.items())},
    }
