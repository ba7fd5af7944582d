"""What a whole compiled round costs on this host, at each tree size the run compiled a round for: AR's round
of one node and each DDTree budget's tree. `node_cost` times the reference round's stages apart; a compiled
round is one graph with one transfer to the host, and timing its stages apart would take a sync each, so it is
timed whole, as the run decodes it.

A sample is a short decode (`loop.decode_from` with the compiled round) from a state the run's decodes are in
(a prompt and half its new tokens, as `node_cost`'s slices): its seconds over its rounds. The decode
experiment takes a slice after some of its prompts, so these samples see the machine as the decodes around
them did. `RoundTimes.round_ms(b)` is linear in nodes between the DDTree sizes compiled, as
`NodeCosts.round_ms` is between the sizes measured, and answers budgets up to the largest compiled: the run
compiles no round for the budgets between, so nothing else about them is known.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import Prefill, decode_from
from remote_worker.decoding.node_cost import SPREAD, StageCost, interpolate
from remote_worker.models.target import TargetModel
from remote_worker.wording import counted

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class RoundTimes:
    """Per tree size timed (nodes, root included; 1 is AR's round), the whole round's cost: the median, fastest,
    slowest and mean sample, each a short decode's milliseconds per round (`round_ms` reads the means, as
    `NodeCosts.round_ms` does, for the reason `StageCost` gives)."""

    sizes: list[int]
    rounds: list[StageCost]
    repeats: int  # samples per size
    device: str
    context: int  # committed tokens when sampled, on average
    kind: str = "compiled"  # what rounds the costs describe (`budget_choice` checks it against the run's)

    def __post_init__(self) -> None:
        if not self.sizes or self.sizes[0] != 1 or sorted(set(self.sizes)) != self.sizes:
            raise ValueError(f"sizes {self.sizes} must start at AR's one node and increase")
        if len(self.rounds) != len(self.sizes):
            raise ValueError(f"{len(self.rounds)} round costs for {len(self.sizes)} sizes")

    @property
    def largest_budget(self) -> int:
        return self.sizes[-1] - 1

    def round_ms(self, budget: int) -> float:
        """A DDTree round of `budget`, linear in nodes between the compiled DDTree sizes around budget + 1.
        AR's round is not one end of that line: it has no draft, which every DDTree round pays whatever its
        tree. Below the smallest compiled budget the line through the two smallest is extended (one DDTree
        size: that size's cost), never below AR's round."""
        if not 1 <= budget <= self.largest_budget:
            raise ValueError(f"budget {budget} is outside the compiled rounds' 1–{self.largest_budget}")
        sizes, rounds, nodes = self.sizes[1:], self.rounds[1:], budget + 1
        if nodes >= sizes[0]:
            return interpolate(sizes, rounds, nodes)
        if len(sizes) == 1:
            return rounds[0].average_ms
        slope = (rounds[1].average_ms - rounds[0].average_ms) / (sizes[1] - sizes[0])
        return max(rounds[0].average_ms - slope * (sizes[0] - nodes), self.ar_round_ms())

    def ar_round_ms(self) -> float:
        return self.rounds[0].average_ms

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "spread": SPREAD}


class RoundTimeSampler:
    """Samples of the run's compiled AR and DDTree rounds (`rounds`, by method scope), gathered from one state
    or several (`measure`), then their figures (`costs`)."""

    kind = "compiled"

    def __init__(self, target: TargetModel, drafter: Any, rounds: dict[str, FixedRound]) -> None:
        # AR's round: budget 0, one node; a round whose size varies (`online_round`) times its own sizes
        timed = [r for r in rounds.values() if r.method in ("ar", "ddtree") and r.one_size]
        if not any(r.method == "ar" for r in timed):
            raise ValueError("no AR round to time, which every prediction divides by")
        self.target, self.drafter = target, drafter
        self.rounds = sorted(timed, key=lambda r: r.nodes)
        self.samples: dict[int, list[float]] = {r.nodes: [] for r in self.rounds}
        self.contexts: list[int] = []

    def measure(self, start: Prefill, tokens: int, repeats: int, progress: Progress | None = None) -> None:
        """`repeats` short decodes of `tokens` new tokens per compiled round from the state of `start` (which
        stays as it is), after one untimed."""
        if repeats < 1 or tokens < 1:
            raise ValueError(f"repeats={repeats} and tokens={tokens} must be at least 1")
        self.contexts.append(start.cache.length)
        for done, fixed in enumerate(self.rounds):
            for attempt in range(repeats + 1):
                temperature = fixed.temperature  # the round was compiled for the run's temperature
                generator = torch.Generator(self.target.device).manual_seed(attempt) if temperature > 0 else None
                result = decode_from(
                    self.target, start, method=fixed.method, max_new_tokens=tokens,
                    drafter=self.drafter if fixed.drafting else None, budget=fixed.budget, rounds=fixed,
                    temperature=temperature, generator=generator,
                )  # fmt: skip
                if attempt and result.rounds:
                    self.samples[fixed.nodes].append(1000 * result.decode_seconds / result.rounds)
            if progress is not None:
                median = statistics.median(self.samples[fixed.nodes])
                progress(
                    done + 1, len(self.rounds), f"{counted(fixed.nodes, 'node')}: round {median:.3g} ms ({self.kind})"
                )

    def costs(self) -> RoundTimes:
        sizes = [r.nodes for r in self.rounds if self.samples[r.nodes]]
        if not sizes or sizes[0] != 1:
            raise ValueError("no compiled round was sampled")
        return RoundTimes(
            kind=self.kind,
            sizes=sizes,
            rounds=[StageCost.of(self.samples[n]) for n in sizes],
            repeats=min(len(self.samples[n]) for n in sizes),
            device=str(self.target.device),
            context=round(statistics.fmean(self.contexts)),
        )
