"""AR's decode time where AR was not decoded: the cost of its steps against context length, fitted on the
records where it was, and the fit's error measured on those records by leaving each one out.

AR decodes one token a step; a step at context c (the prompt and the tokens so far) costs a + b·c: a for
reading the weights and the fixed work of a forward, b for the attention over the cache. A record of P prompt
tokens and L output tokens then takes

    a·L + b·S,   S = P + (P + 1) + … + (P + L − 1) = L·P + L(L − 1)/2

seconds, so its time per token is a + b·S/L. (a, b) are fitted by least squares over the decoded records
(through the origin: no time without a step), b kept ≥ 0 (a cache never makes a step cheaper). A record's L is
its own AR output where AR ran; elsewhere a drafting method's output length stands in: at temperature 0 they
are AR's tokens exactly (lossless decoding), at temperature 1 a draw of the same distribution.

The check is the fit's own: each decoded record predicted by the fit of the others (`leave_one_out`), its
relative error on the record's time per token, and on the set's total, which is what a speedup divides by.
Plain Python (no torch): the sweep's page computes it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.sweep.paper.figures import Record

# The fewest decoded records a fit rests on: two parameters, and a left-out record needs others to be predicted.
MIN_FIT_RECORDS = 3


@dataclass(frozen=True)
class ArSample:
    """One record AR decoded: its prompt's length, its output's and the decode's seconds (prefill excluded)."""

    prompt_tokens: int
    output_tokens: int
    decode_s: float


def context_sum(prompt_tokens: int, output_tokens: int) -> float:
    """S: the contexts AR's steps read, summed (the prompt, then one token more each step)."""
    return output_tokens * prompt_tokens + output_tokens * (output_tokens - 1) / 2


@dataclass(frozen=True)
class ArCost:
    """AR's step cost at context c: `step_s` + `per_context_s`·c seconds, fitted on `records` decoded records."""

    step_s: float
    per_context_s: float
    records: int

    @classmethod
    def fit(cls, samples: Sequence[ArSample]) -> ArCost:
        usable = [s for s in samples if s.output_tokens > 0 and s.decode_s > 0]
        if len(usable) < MIN_FIT_RECORDS:
            raise ValueError(f"AR's step cost needs at least {MIN_FIT_RECORDS} records AR decoded, not {len(usable)}")
        xs = [(float(s.output_tokens), context_sum(s.prompt_tokens, s.output_tokens)) for s in usable]
        ys = [s.decode_s for s in usable]
        # Normal equations of y = a·L + b·S through the origin: [ΣL² ΣLS; ΣLS ΣS²] (a, b) = (ΣLy, ΣSy)
        ll = sum(x[0] * x[0] for x in xs)
        ls = sum(x[0] * x[1] for x in xs)
        ss = sum(x[1] * x[1] for x in xs)
        ly = sum(x[0] * y for x, y in zip(xs, ys, strict=True))
        sy = sum(x[1] * y for x, y in zip(xs, ys, strict=True))
        det = ll * ss - ls * ls
        a, b = ((ly * ss - ls * sy) / det, (ll * sy - ls * ly) / det) if det > 1e-12 * ll * ss else (0.0, -1.0)
        if b < 0 or a <= 0:  # a cache that makes steps cheaper, or none of the cost fixed: the step cost alone
            a, b = ly / ll, 0.0
        return cls(a, b, len(usable))

    def decode_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """The predicted decode seconds of a record."""
        return self.step_s * output_tokens + self.per_context_s * context_sum(prompt_tokens, output_tokens)

    def seconds_per_token(self, prompt_tokens: int, output_tokens: int) -> float:
        return self.decode_s(prompt_tokens, output_tokens) / max(output_tokens, 1)


@dataclass(frozen=True)
class ArCheck:
    """The fit's error on the decoded records, each predicted by the fit of the others.

    `per_record`: relative errors of each left-out record's time per token (predicted / measured − 1);
    `total`: the same for the sum of their decode times, the figure a speedup over many records divides by."""

    per_record: tuple[float, ...]
    total: float

    @property
    def median(self) -> float:
        return statistics.median(abs(e) for e in self.per_record)

    @property
    def worst(self) -> float:
        return max(abs(e) for e in self.per_record)


def leave_one_out(samples: Sequence[ArSample]) -> ArCheck:
    """Each record predicted by the fit of the others; needs MIN_FIT_RECORDS + 1 usable records."""
    usable = [s for s in samples if s.output_tokens > 0 and s.decode_s > 0]
    if len(usable) <= MIN_FIT_RECORDS:
        raise ValueError(
            f"checking AR's fit needs at least {MIN_FIT_RECORDS + 1} records AR decoded, not {len(usable)}"
        )
    errors, predicted = [], 0.0
    for index, sample in enumerate(usable):
        fit = ArCost.fit(usable[:index] + usable[index + 1 :])
        guess = fit.decode_s(sample.prompt_tokens, sample.output_tokens)
        errors.append(guess / sample.decode_s - 1)
        predicted += guess
    return ArCheck(tuple(errors), predicted / sum(s.decode_s for s in usable) - 1)


@dataclass(frozen=True)
class ArTimes:
    """AR's time per token on every record of a set: its own where it decoded the record, predicted elsewhere."""

    seconds_per_token: list[float]  # per record, in the records' order
    measured: list[bool]  # per record: AR decoded it
    cost: ArCost | None  # the fit (None where AR decoded every record)
    check: ArCheck | None  # its leave-one-out error (None without a fit, or too few records to check it)

    @property
    def predicted(self) -> int:
        return self.measured.count(False)


def ar_times(records: Sequence[Record]) -> ArTimes:
    """AR's time per token on each of `records` (`figures.Record`); a record AR did not decode is predicted from
    the fit over those it did, with a drafting method's output length standing in for AR's (the module's)."""
    samples = [ArSample(r.prompt_tokens, len(r.methods["ar"].tokens), r.methods["ar"].decode_s)
               for r in records if "ar" in r.methods]  # fmt: skip
    measured = ["ar" in r.methods for r in records]
    if all(measured):
        return ArTimes([r.methods["ar"].seconds_per_token for r in records], measured, None, None)
    if any(r.prompt_tokens <= 0 for r in records):
        raise ValueError("predicting AR needs every record's prompt length (prompt_tokens)")
    cost = ArCost.fit(samples)
    check = leave_one_out(samples) if len(samples) > MIN_FIT_RECORDS else None
    times = []
    for record in records:
        if "ar" in record.methods:
            times.append(record.methods["ar"].seconds_per_token)
            continue
        stand_in = record.methods.get("dflash") or next(iter(record.methods.values()), None)
        if stand_in is None:
            raise ValueError(f"record {record.id!r} has no decode to take AR's output length from")
        times.append(cost.seconds_per_token(record.prompt_tokens, len(stand_in.tokens)))
    return ArTimes(times, measured, cost, check)
