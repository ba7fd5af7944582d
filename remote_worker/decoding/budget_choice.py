"""The budget this host should use: tokens/s predicted at every budget from the run's tau curves
(`budget_curve`) and the host's measured round costs, checked against the budgets the run decoded.

    predicted tokens/s(b) = tau(b) / round(b)        predicted AR = 1 / round_AR

`round` comes from one set of costs measured at the same moments (slices between the prompts): the eager
round's five terms (`node_cost`: draft, tree, verify, commit and the loop's own work) or, when the run
decoded compiled rounds, the compiled rounds timed whole (`round_times`). The predicted speedup divides the
predicted DDTree speed by AR's speed predicted from the same costs, so that whatever slowed the host while
they were measured scales both; AR's measured speed is kept beside it as a measurement. tau(b) is
`budget_curve.nearest_tau`: from the rounds of the smallest decoded budget at or above b.

**The check.** At every budget the run decoded, the prediction made without that decode's rounds
(`held_out_tau`; the largest decoded budget has none larger, so its own) is set against the measured
tokens/s, and AR's predicted speed against AR's measured: `error_median` and `error_worst` (relative), over
AR and the decoded budgets, since a speedup's error is theirs together.

**The answer never claims more than the run measured.** One budget is named only where its predicted lead
over every decoded rival is larger than the prediction's worst error at the decoded budgets (AR's error is
left out there: it moves every budget's speedup alike), and the run decoded at least `bootstrap.MIN_PROMPTS`
prompts. A rival's strength is the larger of its predicted and its measured speed: a budget the run decoded
and measured faster than the best's prediction is never passed over for it (a `make run` once named 63 at a
predicted ×1.34 beside 16 measured at ×1.89). Otherwise the answer is the range: the budgets whose predicted
speed, or measured speed where decoded, is within that error of the fastest's prediction (`within`), with
the best decoded budget's measurement beside it. The answer is withheld, and the line says why, only where
the prediction contradicts itself or the run:

- its costs describe other rounds than the run decoded (eager costs, compiled decodes);
- by its own costs no budget is faster than AR;
- the run measured every drafting method slower than AR, and the costs say otherwise.

A best budget is chosen among the budgets whose tree fits the device's free memory (`tree_memory`'s count).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from remote_worker.decoding.bootstrap import MIN_PROMPTS
from remote_worker.wording import counted


class RoundCosts(Protocol):
    """What a prediction reads of measured costs (`NodeCosts`, `RoundTimes`)."""

    kind: str  # "eager" or "compiled": the rounds they describe

    @property
    def largest_budget(self) -> int: ...

    def round_ms(self, budget: int) -> float: ...

    def ar_round_ms(self) -> float: ...


@dataclass(frozen=True)
class Measured:
    """A DDTree decode the run made: its budget and figures, for the comparison with the prediction."""

    budget: int
    tokens_per_s: float
    speedup_vs_ar: float


@dataclass(frozen=True)
class Check:
    """The prediction at a decoded budget, made without that decode's rounds, against its measured speed."""

    budget: int
    predicted_tokens_per_s: float
    measured_tokens_per_s: float

    @property
    def error(self) -> float:
        """Relative: predicted / measured − 1."""
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1


@dataclass(frozen=True)
class Prediction:
    budgets: list[int]  # 1 … the largest budget both the tau curves and the costs cover
    tau: list[float]  # per budget: `nearest_tau`
    tokens_per_s: list[float]  # predicted, per budget
    ar_predicted_tokens_per_s: float  # AR from the same costs: what the predicted speedups divide by
    ar_tokens_per_s: float  # AR measured, beside it
    best_budget: int  # the fastest predicted among the budgets that fit (`fits_up_to`)
    best_tokens_per_s: float
    best_speedup_vs_ar: float  # predicted over predicted AR
    measured: list[Measured]  # the run's DDTree decodes, by budget
    checks: list[Check]  # by budget: AR's (budget 0), then one per decoded budget the costs cover
    costs_kind: str  # "eager" or "compiled": the rounds the costs were measured on
    run_kind: str  # the rounds the run decoded
    tree_memory_mb: list[float]  # per budget: the tree's memory by `tree_memory`'s count (a lower bound)
    fits_up_to: int  # the largest budget whose tree fits the free memory (the largest covered when unknown)
    cannot_tell: str  # why the answer is withheld; empty when it is given
    within: list[int]  # the budgets whose predicted speed is within the trees' worst error of the best's
    no_single: str  # why no one budget is named (the answer is then the range `within`); empty when one is

    @property
    def told(self) -> bool:
        """One budget is named: the prediction holds and its lead and the prompts bear it out."""
        return not self.cannot_tell and not self.no_single

    @property
    def ranged(self) -> bool:
        """The answer is the range `within`: the prediction holds, but one budget cannot be told from others."""
        return not self.cannot_tell and bool(self.no_single)

    @property
    def tree_error(self) -> float:
        """The worst error at the decoded budgets (AR's left out: it moves every budget's speedup alike)."""
        return max(abs(c.error) for c in self.checks if c.budget)

    @property
    def at_edge(self) -> bool:
        """The best budget is the largest covered: a larger budget, unmeasured, may be faster still."""
        return self.best_budget == self.budgets[-1]

    @property
    def error_median(self) -> float:
        """The median relative error over AR and the decoded budgets, in absolute value."""
        return statistics.median(abs(c.error) for c in self.checks)

    @property
    def error_worst(self) -> float:
        return max(abs(c.error) for c in self.checks)

    def best_measured(self) -> Measured | None:
        return max(self.measured, key=lambda m: m.speedup_vs_ar, default=None)

    def metrics(self) -> dict[str, float]:
        """`best.predicted_*` where the answer is given (they lead the job's page beside `best.*`), and the
        check's `budget.prediction_error` (median) and `budget.prediction_error_worst` always."""
        figures = {}
        if self.told:
            figures = {
                "best.predicted_budget": float(self.best_budget),
                "best.predicted_speedup_vs_ar": self.best_speedup_vs_ar,
                "best.predicted_tokens_per_s": self.best_tokens_per_s,
            }
        elif self.ranged:
            figures = {"budget.range_low": float(self.within[0]), "budget.range_high": float(self.within[-1])}
        return {**figures, "budget.prediction_error": self.error_median,
                "budget.prediction_error_worst": self.error_worst}  # fmt: skip

    def as_record(self) -> dict[str, Any]:
        """For `decode_summary.json`: the figures, and the terminal's line, which the job's page repeats."""
        record = asdict(self)
        record["checks"] = [{**asdict(c), "error": c.error} for c in self.checks]
        return {**record, "at_edge": self.at_edge, "error_median": self.error_median,
                "error_worst": self.error_worst, "line": self.line()}  # fmt: skip

    def _error_text(self) -> str:
        return f"±{100 * self.error_worst:.0f} % at {_decoded(self.checks)}"

    def line(self) -> str:
        """The terminal's line: `on this host, budget 15 is predicted fastest: ×1.21 vs AR (±4 % at the 3
        budgets decoded; measured at 16: ×1.17)`; where one budget cannot be told from others, the range:
        `on this host, budgets 12–24 are within ±8 % of the fastest predicted (18: ×2.21 vs AR); 16, decoded,
        ran ×2.02 (…)`; or why the run cannot tell."""
        best = self.best_measured()
        measured = f"measured at {best.budget}: ×{best.speedup_vs_ar:.2f}" if best is not None else ""
        if self.cannot_tell:
            return f"the fastest budget cannot be told on this host: {self.cannot_tell}" + (
                f" ({measured})" if measured else ""
            )
        if self.ranged:
            which = f"budgets {spans(self.within)} are" if len(self.within) > 1 else f"budget {self.within[0]} is"
            decoded = sum(1 for c in self.checks if c.budget)
            text = (
                f"on this host, {which} within ±{100 * self.tree_error:.0f} % (the prediction's error at the "
                f"{counted(decoded, 'budget')} decoded) of the fastest predicted, {self.best_budget} at "
                f"×{self.best_speedup_vs_ar:.2f} vs AR"
            )
            if best is not None:
                text += f"; {best.budget}, decoded, ran ×{best.speedup_vs_ar:.2f}"
            return text + f": {self.no_single}" + self._limits()
        text = (
            f"on this host, budget {self.best_budget} is predicted fastest: ×{self.best_speedup_vs_ar:.2f} vs AR "
            f"({self._error_text()}{'; ' + measured if measured else ''})"
        )
        return text + self._limits()

    def _limits(self) -> str:
        """What the answer cannot see past: the largest budget covered, the memory."""
        text = ""
        if self.at_edge:
            text += f"; {self.best_budget} is the largest budget this run can tell, a larger one may be faster"
        if self.fits_up_to < self.budgets[-1]:
            text += f"; budgets above {self.fits_up_to} do not fit the free memory"
        return text


def spans(budgets: list[int]) -> str:
    """`12–24` for a run of consecutive budgets, `8, 12–24` where there are gaps."""
    parts, start = [], budgets[0]
    for previous, budget in zip(budgets, [*budgets[1:], None], strict=True):
        if budget != previous + 1:
            parts.append(f"{start}" if start == previous else f"{start}–{previous}")
            start = budget
    return ", ".join(parts)


def _decoded(checks: list[Check]) -> str:
    """`AR and the 3 budgets decoded`: what the error was taken over."""
    count = sum(1 for c in checks if c.budget)
    return f"AR and the {counted(count, 'budget')} decoded"


def _cannot_tell(
    speeds: dict[int, float],
    best: int,
    ar: float,
    costs_kind: str,
    run_kind: str,
    drafting_slower: bool,
    measured_by: str = "the run",
) -> str:
    """Why the prediction cannot answer at all (the module's list, in that order); empty when it can."""
    if costs_kind != run_kind:
        return f"its costs are of {costs_kind} rounds, and this run decoded {run_kind} ones"
    speedup = speeds[best] / ar
    if speedup < 1:
        return f"by its own costs no budget is faster than AR (the fastest, budget {best}, ×{speedup:.2f})"
    if drafting_slower:
        return (
            f"{measured_by} measured every drafting method slower than AR, and its costs predict budget {best} at "
            f"×{speedup:.2f}: they disagree"
        )
    return ""


def _no_single(speeds: dict[int, float], best: int, checks: list[Check], fits: int, prompts: int | None) -> str:
    """Why one budget cannot be named (the answer is then a range); empty when it can. A decoded rival counts
    at the larger of its predicted and measured speeds (`_strength`)."""
    if prompts is not None and prompts < MIN_PROMPTS:
        return f"{counted(prompts, 'prompt')} are too few to name one budget (at least {MIN_PROMPTS})"
    rivals = [c for c in checks if c.budget not in (0, best) and c.budget <= fits]
    error = max(abs(c.error) for c in checks if c.budget)
    if rivals:
        rival = max(rivals, key=lambda c: _strength(speeds, c))
        lead = speeds[best] / _strength(speeds, rival) - 1
        if rival.measured_tokens_per_s >= speeds[best]:
            return (
                f"{rival.budget} measured {rival.measured_tokens_per_s:.1f} tokens/s, no slower than the "
                f"{speeds[best]:.1f} predicted for {best}"
            )
        if error > lead:
            return f"{best} leads {rival.budget} by {100 * lead:.1f} %, less than that error"
    return ""


def _strength(speeds: dict[int, float], check: Check) -> float:
    """A decoded budget's speed as a rival: the larger of its prediction and its measurement."""
    return max(speeds[check.budget], check.measured_tokens_per_s)


def predict(
    tau: list[float],
    held_out: dict[int, float],
    costs: RoundCosts,
    ar_tokens_per_s: float,
    measured: list[Measured],
    *,
    run_kind: str = "eager",
    drafting_slower: bool = False,
    tree_memory_mb: list[float] | None = None,
    free_mb: float | None = None,
    prompts: int | None = None,
    measured_by: str = "the run",
) -> Prediction:
    """tau: tau(b) for b = 1 … len(tau) (`nearest_tau`); held_out: decoded budget → its `held_out_tau`;
    ar_tokens_per_s: AR's measured speed; tree_memory_mb: the tree's count per budget, which `free_mb` must
    hold (either may be None: nothing known); prompts: how many prompts the figures rest on (None: enough);
    measured_by: what decoded the measured figures, as the lines name it ("phase 1" of a two-phase run, whose
    chosen budget is measured after the prediction and may well be faster than AR)."""
    if ar_tokens_per_s <= 0:
        raise ValueError(f"AR's measured speed must be positive, not {ar_tokens_per_s}")
    if any(m.tokens_per_s <= 0 for m in measured):
        raise ValueError("a decoded budget's measured speed is 0: nothing to check the prediction with")
    largest = min(len(tau), costs.largest_budget)
    if largest < 1:
        raise ValueError("no budget is covered by both the tau curve and the costs")
    budgets = list(range(1, largest + 1))
    speeds = {b: 1000 * tau[b - 1] / costs.round_ms(b) for b in budgets}
    memory = list(tree_memory_mb or [])[:largest]
    if memory and len(memory) < largest:
        raise ValueError(f"tree memory for {len(memory)} budgets, the prediction covers {largest}")
    fits = largest
    if free_mb is not None and memory:
        fitting = [b for b in budgets if memory[b - 1] <= free_mb]
        if not fitting:
            raise ValueError(f"no budget's tree fits the {free_mb:.0f} MB free")
        fits = fitting[-1]
    best = max(budgets[:fits], key=lambda b: (speeds[b], -b))  # the smallest of equally fast budgets
    inside = [m for m in sorted(measured, key=lambda m: m.budget) if m.budget <= largest]
    if not inside:
        raise ValueError("no decoded budget is within the costs measured: nothing to check the prediction with")
    ar = 1000 / costs.ar_round_ms()
    checks = [Check(0, ar, ar_tokens_per_s)]
    checks += [Check(m.budget, 1000 * held_out[m.budget] / costs.round_ms(m.budget), m.tokens_per_s) for m in inside]
    error = max(abs(c.error) for c in checks if c.budget)
    strength = {b: speeds[b] for b in budgets[:fits]} | {c.budget: _strength(speeds, c) for c in checks[1:]
                                                         if c.budget <= fits}  # fmt: skip
    within = [b for b in budgets[:fits] if strength[b] * (1 + error) >= speeds[best]]
    return Prediction(
        budgets=budgets,
        tau=tau[:largest],
        tokens_per_s=[speeds[b] for b in budgets],
        ar_predicted_tokens_per_s=ar,
        ar_tokens_per_s=ar_tokens_per_s,
        best_budget=best,
        best_tokens_per_s=speeds[best],
        best_speedup_vs_ar=speeds[best] / ar,
        measured=inside,
        checks=checks,
        costs_kind=costs.kind,
        run_kind=run_kind,
        tree_memory_mb=memory,
        fits_up_to=fits,
        cannot_tell=_cannot_tell(speeds, best, ar, costs.kind, run_kind, drafting_slower, measured_by),
        within=within,
        no_single=_no_single(speeds, best, checks, fits, prompts),
    )
