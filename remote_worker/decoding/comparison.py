"""AR, DFlash and DDTree side by side over a prompt set: what `experiment=ddtree_gdn` and `make bench` report.

Each prompt is prefilled once; every method decodes it from a copy of that state, so the prefill (the same
work for all methods) is measured once and kept out of the decode figures. The methods take turns —
repeat 0 of every method, then repeat 1, … — so a machine that slows down mid-run slows all of them
alike; speedups are taken within one repeat, then the median over repeats is reported with its range.
AR decodes first: its tokens are the reference for `lossless`, and its margins explain divergences.

Tau and the speedups also get a 95 % bootstrap interval over prompts (`*_ci_low`, `*_ci_high`, see
`remote_worker.decoding.bootstrap`): the range over repeats says how steady the timing was, the interval how
much the figure depends on which prompts were asked. DDTree is also set against DFlash (`speedup_vs_dflash`),
paired in the same way as every method against AR.

Sampling (temperature > 0) draws from a generator seeded by the run's seed and the prompt's index, so the
repeats of a method time the same work and no method's draws depend on which methods ran before it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from remote_worker.decoding import bootstrap, peak_memory
from remote_worker.decoding.divergence import Divergence, first_divergence
from remote_worker.decoding.figure_rules import ONLINE
from remote_worker.decoding.fixed_prefill import FixedPrefill
from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import DecodeResult, decode_from, prefill
from remote_worker.decoding.online_budget import OnlineBudget
from remote_worker.models.target import TargetModel


@dataclass(frozen=True)
class Method:
    scope: str  # the child run's name: ar, dflash, ddtree_tb32, …
    name: str  # ar, dflash or ddtree
    budget: int = 0

    @property
    def drafts(self) -> bool:
        return self.name != "ar"

    @property
    def decoder(self) -> str:
        """The loop's method that decodes it (`ddtree_online` is a DDTree whose rounds choose their budget)."""
        return "ddtree" if self.name == ONLINE else self.name


def methods_for(budgets: Sequence[int], online: bool = False) -> list[Method]:
    """AR (first: the reference), DFlash, then DDTree at every tree budget; `online`: and `ddtree_online`, whose
    rounds grow the largest budget's tree and verify as much of it as each round is worth (`online_budget`)."""
    methods = [Method("ar", "ar"), Method("dflash", "dflash")] + [Method(f"ddtree_tb{b}", "ddtree", b) for b in budgets]
    return methods + ([Method(ONLINE, ONLINE, max(budgets))] if online else [])


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int
    temperature: float = 0.0
    repeats: int = 1
    stop_tokens: frozenset[int] = frozenset()
    seed: int = 0


@dataclass
class PromptRun:
    """One prompt decoded by every method, `repeats` times each, from one prefill."""

    index: int
    tokens: list[int]  # the prompt's token ids
    prefill_target_seconds: float
    prefill_draft_seconds: float
    results: dict[str, list[DecodeResult]]  # scope -> one result per repeat

    def first(self, scope: str) -> DecodeResult:
        return self.results[scope][0]

    def prefill_seconds(self, method: Method) -> float:
        """The prefill a method needs: the target's, and for a drafting method the drafter's as well."""
        return self.prefill_target_seconds + (self.prefill_draft_seconds if method.drafts else 0.0)


def run_prompt(
    target: TargetModel,
    drafter: Any | None,
    tokens: torch.Tensor,
    methods: Sequence[Method],
    settings: Settings,
    index: int,
    before_decode: Callable[[Method, int], None] | None = None,
    rounds: dict[str, FixedRound] | None = None,
    prefiller: FixedPrefill | None = None,
    online: dict[str, OnlineBudget] | None = None,
) -> PromptRun:
    """Prefill `tokens` once (through `prefiller` when given: fixed-shape chunks), then decode them with every
    method, repeats interleaved; a method with a fixed-shape round in `rounds` (by scope) decodes with it;
    `ddtree_online` with its policy in `online` (by scope; without one, at its largest budget)."""
    if any(m.name == "ar" for m in methods) and methods[0].name != "ar":
        raise ValueError("AR must decode first: it is the reference of every other method")
    drafting = any(m.drafts for m in methods)
    start = prefill(target, tokens, drafter if drafting else None, prefiller)
    results: dict[str, list[DecodeResult]] = {m.scope: [] for m in methods}
    for repeat in range(settings.repeats):
        for method in methods:
            if before_decode is not None:
                before_decode(method, repeat)
            peak_memory.reset(target.device)
            result = decode_from(
                target,
                start,
                method=method.decoder,
                max_new_tokens=settings.max_new_tokens,
                drafter=drafter if method.drafts else None,
                budget=method.budget,
                temperature=settings.temperature,
                stop_tokens=settings.stop_tokens,
                generator=torch.Generator(target.device).manual_seed(prompt_seed(settings.seed, index)),
                record_margins=method.name == "ar" and settings.temperature == 0,
                rounds=(rounds or {}).get(method.scope),
                online=None if method.scope in (rounds or {}) else (online or {}).get(method.scope),
            )
            result.peak_memory_bytes = peak_memory.peak_bytes(target.device)
            results[method.scope].append(result)
    return PromptRun(index, tokens.tolist(), start.target_seconds, start.draft_seconds, results)


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of a prompt: the run's seed and the prompt's index, kept within 64 bits."""
    return (seed * 1_000_003 + index) % 2**64


def repetition_flags(
    prompt: list[int], tokens: list[int], acceptance_lengths: list[int], max_period: int = 16
) -> list[bool]:
    """For each round: do its committed tokens only repeat what came `p` tokens earlier, for some p <= 16?

    A tiny model easily falls into a loop or a run of whitespace, which any drafter predicts perfectly; this
    marks such rounds, so that a high tau can be told apart from a degenerate continuation."""
    sequence, start, flags = prompt + tokens, len(prompt), []
    for accepted in acceptance_lengths:
        end = min(start + accepted + 1, len(sequence))
        flags.append(
            any(
                all(sequence[k] == sequence[k - p] for k in range(start, end))
                for p in range(1, min(max_period, start) + 1)
            )
        )
        start = end
    return flags


def _spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max); zeros when empty."""
    return (statistics.median(values), min(values), max(values)) if values else (0.0, 0.0, 0.0)


@dataclass
class MethodTally:
    """One method's results over the prompts so far. Tokens, acceptance and divergences come from repeat 0
    (every repeat decodes the same tokens); timings from every repeat."""

    method: Method
    repeat_tokens: list[int] = field(default_factory=list)  # per repeat, summed over prompts
    repeat_seconds: list[float] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    # Per stage, over the rounds that timed their stages (fixed-shape rounds do not: a sync per stage)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    timed_rounds: int = 0  # rounds over every repeat, for the per-round stage times
    prefill_seconds: list[float] = field(default_factory=list)  # per prompt
    ttft_seconds: list[float] = field(default_factory=list)  # per prompt and repeat: prefill + first round
    prompts: int = 0
    matches: int = 0
    near_ties: int = 0
    unexplained: int = 0
    repetitive_rounds: int = 0
    fresh_round_tokens: list[int] = field(default_factory=list)  # tokens per round of the other rounds
    fixed: bool = False  # decoded with fixed-shape rounds (whose trees may be flagged inexact)
    peak_memory_bytes: int | None = None  # the highest of its decodes' peaks (`peak_memory`)
    inexact_trees: int = 0
    # Per prompt, for the bootstrap over prompts: committed tokens (bonus included) and rounds of repeat 0,
    # and per repeat the generated tokens and decode seconds (sums over prompts: repeat_tokens, repeat_seconds)
    prompt_committed: list[int] = field(default_factory=list)
    prompt_rounds: list[int] = field(default_factory=list)
    prompt_tokens: list[list[int]] = field(default_factory=list)
    prompt_seconds: list[list[float]] = field(default_factory=list)

    def add(self, run: PromptRun, divergence: Divergence | None) -> None:
        results = run.results[self.method.scope]
        if not self.repeat_tokens:
            self.repeat_tokens = [0] * len(results)
            self.repeat_seconds = [0.0] * len(results)
        prefill_seconds = run.prefill_seconds(self.method)
        for repeat, result in enumerate(results):
            self.repeat_tokens[repeat] += len(result.tokens)
            self.repeat_seconds[repeat] += result.decode_seconds
            self.ttft_seconds.append(prefill_seconds + result.first_token_seconds)
            if result.peak_memory_bytes is not None:
                self.peak_memory_bytes = max(self.peak_memory_bytes or 0, result.peak_memory_bytes)
            if result.stage_seconds:
                self.timed_rounds += result.rounds
            for stage, seconds in result.stage_seconds.items():
                self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + seconds
        first = results[0]
        self.prompt_committed.append(sum(a + 1 for a in first.acceptance_lengths))
        self.prompt_rounds.append(len(first.acceptance_lengths))
        self.prompt_tokens.append([len(result.tokens) for result in results])
        self.prompt_seconds.append([result.decode_seconds for result in results])
        self.fixed |= first.fixed
        self.inexact_trees += first.inexact_trees
        self.acceptance_lengths += first.acceptance_lengths
        flags = repetition_flags(run.tokens, first.tokens, first.acceptance_lengths)
        self.repetitive_rounds += sum(flags)
        self.fresh_round_tokens += [a + 1 for a, f in zip(first.acceptance_lengths, flags, strict=True) if not f]
        self.prefill_seconds.append(prefill_seconds)
        self.prompts += 1
        self.matches += divergence is None
        if divergence is not None:
            self.near_ties += divergence.near_tie
            self.unexplained += not divergence.near_tie

    def tokens_per_s(self) -> list[float]:
        return [t / s if s else 0.0 for t, s in zip(self.repeat_tokens, self.repeat_seconds, strict=True)]

    def speedups(self, base: MethodTally) -> list[float]:
        """Tokens/s over the base's, within each repeat (the same prompts, the same machine state)."""
        return [r / b if b else 0.0 for r, b in zip(self.tokens_per_s(), base.tokens_per_s(), strict=True)]

    def speedup_interval(self, base: MethodTally) -> bootstrap.Interval | None:
        """The speedup's 95 % interval over prompts, paired: this method and the base on the same draws."""
        mine, theirs = (self.prompt_tokens, self.prompt_seconds), (base.prompt_tokens, base.prompt_seconds)
        return bootstrap.speedup_interval(*mine, *theirs)

    def intervals(self, ar: MethodTally, dflash: MethodTally | None) -> dict[str, float]:
        """`tau_ci_*` and `speedup_vs_ar_ci_*` of a drafting method, and DDTree's `speedup_vs_dflash` with its
        interval when DFlash ran. None of them with fewer than `bootstrap.MIN_PROMPTS` prompts: so few have too
        little spread to resample, and a narrow interval would claim a certainty the run does not have. AR has none: its
        tau and its speedup are 1 by definition."""
        figures: dict[str, float] = {}
        if not self.method.drafts:
            return figures
        tau = bootstrap.tau_interval(self.prompt_committed, self.prompt_rounds)
        if tau is not None:
            figures.update(tau_ci_low=tau.low, tau_ci_high=tau.high)
        versus_ar = self.speedup_interval(ar)
        if versus_ar is not None:
            figures.update(speedup_vs_ar_ci_low=versus_ar.low, speedup_vs_ar_ci_high=versus_ar.high)
        if self.method.name in ("ddtree", ONLINE) and dflash is not None and dflash.repeat_tokens:
            figures["speedup_vs_dflash"] = _spread(self.speedups(dflash))[0]
            versus_dflash = self.speedup_interval(dflash)
            if versus_dflash is not None:
                figures.update(speedup_vs_dflash_ci_low=versus_dflash.low, speedup_vs_dflash_ci_high=versus_dflash.high)
        return figures

    def metrics(self, ar: MethodTally, exactness: bool, dflash: MethodTally | None = None) -> dict[str, float]:
        """The method's summary metrics (see the metric table in docs/decoding.md). `exactness`: temperature 0, where
        outputs are compared with AR's; `dflash`: DFlash's tally, which DDTree is set against."""
        rounds = max(len(self.acceptance_lengths), 1)
        rates = self.tokens_per_s()
        tokens_per_s, tokens_per_s_min, tokens_per_s_max = _spread(rates)
        speedup, speedup_min, speedup_max = _spread(self.speedups(ar))
        metrics = {
            "tau": sum(a + 1 for a in self.acceptance_lengths) / rounds,
            "acceptance_length_mean": sum(self.acceptance_lengths) / rounds,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_min": tokens_per_s_min,
            "tokens_per_s_max": tokens_per_s_max,
            "speedup_vs_ar": speedup,
            "speedup_vs_ar_min": speedup_min,
            "speedup_vs_ar_max": speedup_max,
            **self.intervals(ar, dflash),
            "tpot_ms": 1000 / tokens_per_s if tokens_per_s else 0.0,
            "prefill_ms": 1000 * statistics.fmean(self.prefill_seconds) if self.prefill_seconds else 0.0,
            "ttft_ms": 1000 * statistics.fmean(self.ttft_seconds) if self.ttft_seconds else 0.0,
            **{
                f"{stage}_ms_per_round": 1000 * seconds / max(self.timed_rounds, 1)
                for stage, seconds in self.stage_seconds.items()
            },
            "rounds": float(len(self.acceptance_lengths)),
            "repetition_share": self.repetitive_rounds / rounds,
            "tau_without_repetition": sum(self.fresh_round_tokens) / max(len(self.fresh_round_tokens), 1),
            "generated_tokens": float(self.repeat_tokens[0] if self.repeat_tokens else 0),
            "repeats": float(len(self.repeat_tokens)),
            "prompts": float(self.prompts),
        }
        if self.peak_memory_bytes is not None:
            metrics["peak_memory_mb"] = self.peak_memory_bytes / (1 << 20)
        if self.fixed:  # trees whose scores rounded, so that they may differ from the host heap's at a tie
            metrics["inexact_trees"] = float(self.inexact_trees)
        if exactness:
            metrics["lossless"] = self.matches / max(self.prompts, 1)
            metrics["near_tie_divergences"] = float(self.near_ties)
            metrics["unexplained_divergences"] = float(self.unexplained)
        return metrics


class Comparison:
    """Every method's tally over a prompt set; `add` each `PromptRun`, then read `metrics`."""

    def __init__(self, methods: Sequence[Method], temperature: float, dtype: torch.dtype) -> None:
        self.methods = list(methods)
        self.exactness = temperature == 0
        self.dtype = dtype
        self.tallies = {m.scope: MethodTally(m) for m in methods}

    def divergences(self, run: PromptRun) -> dict[str, Divergence | None]:
        """Each method's first difference from AR's output (None where it matches; all None at T > 0)."""
        if not self.exactness:
            return dict.fromkeys(run.results)
        ar = run.first(self.methods[0].scope)
        return {
            scope: first_divergence(ar.tokens, ar.margins, results[0].tokens, self.dtype)
            for scope, results in run.results.items()
        }

    def add(self, run: PromptRun) -> dict[str, Divergence | None]:
        divergences = self.divergences(run)
        for scope, tally in self.tallies.items():
            tally.add(run, divergences[scope])
        return divergences

    def tau_so_far(self, scope: str) -> float | None:
        """The method's tau over the prompts added so far (for progress lines); None before the first."""
        lengths = self.tallies[scope].acceptance_lengths
        return sum(a + 1 for a in lengths) / len(lengths) if lengths else None

    def tokens_per_s_so_far(self, scope: str) -> float | None:
        """The method's decode speed over the prompts added so far (first pass; for progress lines)."""
        tally = self.tallies[scope]
        return tally.tokens_per_s()[0] if tally.repeat_seconds and tally.repeat_seconds[0] else None

    def metrics(self) -> dict[str, dict[str, float]]:
        ar = self.tallies[self.methods[0].scope]
        dflash = next((self.tallies[m.scope] for m in self.methods if m.name == "dflash"), None)
        metrics = {scope: tally.metrics(ar, self.exactness, dflash) for scope, tally in self.tallies.items()}
        fixed = [t for t in self.tallies.values() if t.method.name == "ddtree" and t.repeat_tokens]
        for tally in self.tallies.values():
            if tally.method.name == ONLINE and tally.repeat_tokens and fixed:
                metrics[tally.method.scope].update(versus_best_fixed(tally, fixed))
        return metrics


def versus_best_fixed(online: MethodTally, fixed: Sequence[MethodTally]) -> dict[str, float]:
    """`ddtree_online` against the fixed budget that decoded fastest on the same prompts (its median tokens/s
    over passes): `speedup_vs_best_fixed`, the ratio of speeds within each pass, median over passes, with its
    paired 95 % interval over prompts, and that budget (`best_fixed_budget`). The best is picked after the fact
    from noisy measurements, which favours it: a per-round budget level with it has matched the grid's answer
    without running the grid."""
    best = max(fixed, key=lambda t: _spread(t.tokens_per_s())[0])
    figures = {
        "speedup_vs_best_fixed": _spread(online.speedups(best))[0],
        "best_fixed_budget": float(best.method.budget),
    }
    interval = online.speedup_interval(best)
    if interval is not None:
        figures.update(speedup_vs_best_fixed_ci_low=interval.low, speedup_vs_best_fixed_ci_high=interval.high)
    return figures
