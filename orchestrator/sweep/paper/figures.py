"""The DDTree paper's table figures, computed the paper's way from the records a decode wrote.

A record is one turn of one prompt (`generations.jsonl`, a row each). For each method the paper takes:

- a record's time per output token: its decode time (after the prefill: ours is timed from the first round,
  the target's and the drafter's prefill apart) over the tokens it output;
- speedup = the mean over records of AR's time per token ÷ the mean over records of the method's. With the
  same records on both sides that is Σ AR's ÷ Σ the method's, so it resamples as a ratio of sums;
- tau = the mean over records of the record's own tau (tokens committed per round, the bonus token included);
- the DDTree cell: the budget with the best speedup among those decoded.

Where our rule differs. A final round cut by the token limit counts the tokens it kept in our record's tau
(the paper's counts its whole acceptance); with 2,048 new tokens that is one round in hundreds.

Each figure has a 95 % percentile-bootstrap interval over records (`remote_worker.decoding.bootstrap`: the
same draws, paired between the methods of one record), none under MIN_PROMPTS records.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from remote_worker.decoding.figure_rules import MIN_PROMPTS, Interval


class RecordsDisagree(ValueError):
    """Two shards hold the same record with different tokens: they were not decoded with the same settings."""


@dataclass(frozen=True)
class MethodRecord:
    tokens: tuple[int, ...]
    decode_s: float  # the median over repeats (`decode_report.generation_row`)
    tau: float

    @property
    def seconds_per_token(self) -> float:
        return self.decode_s / max(len(self.tokens), 1)


@dataclass(frozen=True)
class Record:
    id: str
    methods: dict[str, MethodRecord]  # scope -> its decode of this record
    prompt_tokens: int = 0  # the prompt's length as the model saw it (what AR's predicted cost reads)


def read_records(lines: Iterable[str]) -> list[Record]:
    """The records of a `generations.jsonl`, in the order of their first rows. A record decoded in two phases
    (`decode.protocol=two_phase`) has a row each: their methods are merged; a method in both is an error."""
    records: dict[str, Record] = {}
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        methods = {
            scope: MethodRecord(
                tuple(out.get("tokens") or ()), float(out.get("decode_s") or 0.0), float(out.get("tau") or 0)
            )
            for scope, out in (row.get("methods") or {}).items()
        }
        key = str(row["id"])
        seen = records.get(key)
        if seen is not None:
            if twice := sorted(set(seen.methods) & set(methods)):
                raise ValueError(f"record {key!r} has two rows for {', '.join(twice)}")
            methods = {**seen.methods, **methods}
        records[key] = Record(key, methods, int(row.get("prompt_tokens") or 0))
    return list(records.values())


def merge(shards: Sequence[Sequence[Record]]) -> list[Record]:
    """The shards of one (dataset, temperature) as one set of records, ordered by id. A record that two
    shards both decoded counts once, and only when both emitted the same tokens."""
    merged: dict[str, Record] = {}
    for shard in shards:
        for record in shard:
            seen = merged.get(record.id)
            if seen is not None and {s: m.tokens for s, m in seen.methods.items()} != {
                s: m.tokens for s, m in record.methods.items()
            }:
                raise RecordsDisagree(f"record {record.id!r} was decoded twice with different tokens")
            merged.setdefault(record.id, record)
    return [merged[key] for key in sorted(merged, key=_id_order)]


def _id_order(record_id: str) -> tuple[str, int, int]:
    """`gsm8k-10` after `gsm8k-9`; `mt-bench-3#2` after `mt-bench-3`."""
    base, _, turn = record_id.partition("#")
    stem, _, number = base.rpartition("-")
    return (stem, int(number) if number.isdigit() else -1, int(turn) if turn.isdigit() else 1)


@dataclass(frozen=True)
class Cell:
    """One method's figures on one set of records (`speedup` over AR, `tau`), each with its interval."""

    method: str
    speedup: float
    tau: float
    speedup_ci: Interval | None
    tau_ci: Interval | None
    records: int
    budget: int | None = None  # DDTree's budget


def cell(records: Sequence[Record], scope: str, budget: int | None = None, ar: Sequence[float] | None = None) -> Cell:
    """The method's figures over `records`; AR's time per token is each record's own decode, or `ar` (one per
    record: measured where AR ran, predicted elsewhere, `ar_prediction`)."""
    import torch  # here, not at the top: only the paper's table pays its import, not every sweep's page

    from remote_worker.decoding.bootstrap import bootstrap, ratio

    if ar is None:
        ar = [r.methods["ar"].seconds_per_token for r in records]
    if len(ar) != len(records):
        raise ValueError(f"{len(ar)} AR times for {len(records)} records")
    ar_times = torch.tensor(list(ar), dtype=torch.float64)
    mine = torch.tensor([r.methods[scope].seconds_per_token for r in records], dtype=torch.float64)
    taus = torch.tensor([r.methods[scope].tau for r in records], dtype=torch.float64)
    speedup = float(ratio(ar_times.sum(), mine.sum()))
    tau = statistics.fmean(taus.tolist()) if records else 0.0
    speedup_ci = tau_ci = None
    if len(records) >= MIN_PROMPTS:
        speedup_ci = bootstrap(torch.stack([ar_times, mine], dim=1), lambda sums: ratio(sums[:, 0], sums[:, 1]))
        ones = torch.ones_like(taus)
        tau_ci = bootstrap(torch.stack([taus, ones], dim=1), lambda sums: ratio(sums[:, 0], sums[:, 1]))
    return Cell(scope, speedup, tau, speedup_ci, tau_ci, len(records), budget)


def ddtree_scopes(records: Sequence[Record]) -> dict[str, int]:
    """The DDTree methods every record has, scope -> budget."""
    scopes = set.intersection(*(set(r.methods) for r in records)) if records else set()
    return {s: int(s.removeprefix("ddtree_tb")) for s in scopes if s.startswith("ddtree_tb") and s[9:].isdigit()}


def best_ddtree(records: Sequence[Record]) -> Cell | None:
    """The paper's DDTree cell: the decoded budget with the best speedup (the smaller budget at a tie)."""
    cells = [
        cell(records, scope, budget) for scope, budget in sorted(ddtree_scopes(records).items(), key=lambda x: x[1])
    ]
    return max(cells, key=lambda c: c.speedup, default=None)
