"""The budget this host should use: tokens/s predicted at every budget from one run's tau curve
(`budget_curve`) and the host's measured round costs (`node_cost`).

    predicted tokens/s(b) = tau(b) / (draft + tree(b + 1) + verify(b + 1) + commit)

with each stage's median cost interpolated between the tree sizes measured (`NodeCosts.round_ms`). The
predicted speedup divides that by AR's measured tokens/s, the reference every measured `speedup_vs_ar` of
the run divides by, so the two read alike. AR's round as the same model predicts it (verify(1) +
commit(1), one token, no draft) is in the record too: it leaves out what the stages do (the walk, the
loop's own Python), which weighs most on AR's one-token rounds (on the trained tiny pair it read 7 % faster
than AR measured, while the DDTree budgets' predictions fell within −15 … +2 % of their measurements).
The prediction at each budget the run decoded is in the record beside the measurement, so a reader sees
how far to trust the curve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from remote_worker.decoding.node_cost import NodeCosts


@dataclass(frozen=True)
class Measured:
    """A DDTree decode the run made: its budget and figures, for the comparison with the prediction."""

    budget: int
    tokens_per_s: float
    speedup_vs_ar: float


@dataclass(frozen=True)
class Prediction:
    budgets: list[int]  # 1 … the largest budget both the tau curve and the node costs cover
    tokens_per_s: list[float]  # predicted, per budget
    ar_tokens_per_s: float  # AR measured: what the predicted speedups divide by
    ar_predicted_tokens_per_s: float  # AR as the same costs predict it (verify + commit of one node)
    best_budget: int
    best_tokens_per_s: float
    best_speedup_vs_ar: float
    measured: list[Measured]  # the run's DDTree decodes, by budget
    predicted_at_measured: list[float]  # the prediction at each measured budget
    compiled: bool  # the run decoded with compiled rounds, which the (eager) stage costs do not describe

    @property
    def at_edge(self) -> bool:
        """The best budget is the largest covered: a larger budget, unmeasured, may be faster still."""
        return self.best_budget == self.budgets[-1]

    def best_measured(self) -> Measured | None:
        return max(self.measured, key=lambda m: m.speedup_vs_ar, default=None)

    def as_record(self) -> dict[str, Any]:
        """For `decode_summary.json`: the figures, and the terminal's line, which the job's page repeats."""
        return {**asdict(self), "at_edge": self.at_edge, "line": self.line()}

    def line(self) -> str:
        """The terminal's line: `on this host, budget 48 is predicted fastest: ×3.9 vs AR (measured at 32:
        ×3.7)`, and why it may be more where the best is the largest budget the run covers."""
        text = f"on this host, budget {self.best_budget} is predicted fastest: ×{self.best_speedup_vs_ar:.2f} vs AR"
        best = self.best_measured()
        if best is not None:
            text += f" (measured at {best.budget}: ×{best.speedup_vs_ar:.2f})"
        if self.at_edge:
            text += f"; {self.best_budget} is the largest budget this run can tell, a larger one may be faster"
        if self.compiled:
            text += "; costs of eager rounds, this run decoded compiled ones"
        return text


def predict(
    tau: list[float], costs: NodeCosts, ar_tokens_per_s: float, measured: list[Measured], compiled: bool = False
) -> Prediction:
    """tau: tau(b) for b = 1 … len(tau) (`BudgetCurve.tau`); ar_tokens_per_s: AR's measured speed."""
    if ar_tokens_per_s <= 0:
        raise ValueError(f"AR's measured speed must be positive, not {ar_tokens_per_s}")
    largest = min(len(tau), costs.largest_budget)
    if largest < 1:
        raise ValueError("no budget is covered by both the tau curve and the node costs")
    budgets = list(range(1, largest + 1))
    speeds = [1000 * tau[b - 1] / costs.round_ms(b) for b in budgets]
    best = max(budgets, key=lambda b: (speeds[b - 1], -b))  # the smallest of equally fast budgets
    inside = [m for m in sorted(measured, key=lambda m: m.budget) if m.budget <= largest]
    return Prediction(
        budgets=budgets,
        tokens_per_s=speeds,
        ar_tokens_per_s=ar_tokens_per_s,
        ar_predicted_tokens_per_s=1000 / (costs.round_ms(0) - costs.draft.median_ms),
        best_budget=best,
        best_tokens_per_s=speeds[best - 1],
        best_speedup_vs_ar=speeds[best - 1] / ar_tokens_per_s,
        measured=inside,
        predicted_at_measured=[speeds[m.budget - 1] for m in inside],
        compiled=compiled,
    )
