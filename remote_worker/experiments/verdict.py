"""Which drafting method a job names best, and how sure that is: the `best.*` tags and metrics, the page's
Best line and the terminal's `best` row.

A method is crowned only where its speedup's 95 % interval over prompts clears the runner-up's (its low end
above the runner-up's high end): a fastest median alone was noise often enough (three identical one-pass runs
once named three different winners, and a sweep crowned a job whose interval, 0.73–1.80, held 1). An interval
rests on at least `bootstrap.MIN_PROMPTS` prompts; with fewer there is none, nothing is crowned and the basis
names the leader and its runner-up (as the sweep's page does) and how many prompts the figures rest on.
"""

from __future__ import annotations

from dataclasses import dataclass

from remote_worker.decoding.bootstrap import MIN_PROMPTS
from remote_worker.decoding.comparison import Method
from remote_worker.wording import counted

SLOWER = "slower than AR, as is every drafting method here"


@dataclass(frozen=True)
class Verdict:
    """`best` is the method named, or None where no method is clearly ahead; `basis` says how far the naming
    can be trusted, in the words the page shows."""

    fastest: str  # the drafting method with the highest median speedup_vs_ar
    best: str | None
    basis: str


def _interval(metrics: dict[str, float]) -> tuple[float, float] | None:
    low, high = metrics.get("speedup_vs_ar_ci_low"), metrics.get("speedup_vs_ar_ci_high")
    return None if low is None or high is None else (low, high)


def _figure(scope: str, metrics: dict[str, float]) -> str:
    interval = _interval(metrics)
    span = f" ({interval[0]:.2f}–{interval[1]:.2f})" if interval is not None else ""
    return f"{scope} ×{metrics['speedup_vs_ar']:.2f}{span}"


def judge(summary: dict[str, dict[str, float]]) -> Verdict | None:
    """The verdict over the methods' figures (see the module); None where no drafting method ran. A fastest
    method slower than AR says that first."""
    drafting = {scope: metrics for scope, metrics in summary.items() if scope != "ar"}
    if not drafting:
        return None
    ranked = sorted(drafting, key=lambda scope: drafting[scope]["speedup_vs_ar"], reverse=True)
    fastest, figures = ranked[0], drafting[ranked[0]]
    slower = figures["speedup_vs_ar"] < 1
    prompts = int(figures.get("prompts", 0))
    mine = _interval(figures)
    if mine is None:  # named as the sweep's page names them, leader and runner-up, but not crowned
        on = f"on {counted(prompts, 'prompt')}" if prompts else "on too few prompts"
        lead = _figure(fastest, figures) + (f" leads {_figure(ranked[1], drafting[ranked[1]])}" * (len(ranked) > 1))
        basis = f"no method is crowned: {lead} {on}, too few for a 95 % interval (at least {MIN_PROMPTS})"
        return Verdict(fastest, None, (f"{SLOWER}; " if slower else "") + basis)
    if len(ranked) == 1:
        return Verdict(fastest, fastest, (f"{SLOWER}; " if slower else "") + "the only drafting method")
    rival = ranked[1]
    theirs = _interval(drafting[rival])
    over = f"95 % intervals over {counted(prompts, 'prompt')}"
    pair = f"{_figure(fastest, figures)} {{}} {_figure(rival, drafting[rival])}, {over}"
    if theirs is not None and mine[0] > theirs[1]:
        basis = "its interval clears the runner-up's: " + pair.format("against")
        return Verdict(fastest, fastest, (f"{SLOWER}; " if slower else "") + basis)
    basis = "no method is clearly ahead: " + pair.format("overlaps")
    return Verdict(fastest, None, basis + ("; every drafting method is slower than AR" if slower else ""))


def best_record(verdict: Verdict | None) -> dict[str, str | None] | None:
    """The verdict in `decode_summary.json`, whence the description's Best line: `scope` is the method named
    best, null where none is clearly ahead (`basis` then says so)."""
    if verdict is None:
        return None
    return {"scope": verdict.best, "fastest": verdict.fastest, "basis": verdict.basis}


def best_tags(verdict: Verdict, methods: list[Method]) -> dict[str, str]:
    """`best.basis` always; `best.method` and `best.tree_budget` only where a best is named."""
    tags = {"best.basis": verdict.basis}
    if verdict.best is not None:
        tags["best.method"] = verdict.best
        budget = next((m.budget for m in methods if m.scope == verdict.best), None)
        if budget:
            tags["best.tree_budget"] = str(budget)
    return tags
