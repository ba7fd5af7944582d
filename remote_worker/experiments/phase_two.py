"""`decode.protocol=two_phase`: phase 2 of the decode experiment (`decoding.two_phase` says why).

Phase 1 has decoded the sample with AR, DFlash and DDTree at the largest budget, and measured the host's round
costs; its prediction names the budget phase 2 decodes (`choose_budget`). Phase 2 then decodes, in the records'
order:

- a sampled record: DDTree at the chosen budget only (phase 1 decoded the rest), from the very prompt phase 1
  decoded; its figures join phase 1's, paired with AR's on the same record, and at temperature 0 its tokens are
  checked against AR's;
- any other record: DFlash and DDTree at the chosen budget; at temperature 0 DDTree's tokens are checked
  against DFlash's (no AR ran there: two exact methods agree or one of them is wrong).

Each decoded record is a row of `generations.jsonl` (`"phase": 2`); a sampled record's phase-2 row holds the
chosen budget's output beside its phase-1 row, and readers merge the two (`sweep.paper.figures.read_records`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from remote_worker.decoding.budget_choice import Prediction
from remote_worker.decoding.comparison import Method, PromptRun
from remote_worker.decoding.two_phase import PROTOCOLS, Choice, choose_budget
from remote_worker.events import EventLog
from remote_worker.experiments.record_loop import Progress, RecordLoop, Tallies, Turn
from remote_worker.prompt_set import Prompt
from remote_worker.wording import counted

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Protocol:
    """`decode.protocol` and `decode.sample_every`."""

    kind: str
    every: int

    @property
    def two_phase(self) -> bool:
        return self.kind == "two_phase"


def protocol_of(decode: dict[str, Any]) -> Protocol:
    kind = str(decode.get("protocol") or "grid")
    if kind not in PROTOCOLS:
        raise ValueError(f"decode.protocol={kind!r} must be one of {', '.join(PROTOCOLS)}")
    every = decode.get("sample_every", 8)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"decode.sample_every={every!r} must be a positive integer (phase 1 decodes every k-th record)"
        )
    return Protocol(kind, every)


@dataclass(frozen=True)
class PhaseTwo:
    """What phase 2 decoded and what its checks found (`decode_summary.json`'s `protocol`)."""

    kind: str
    every: int
    sample_records: int  # records phase 1 decoded (turns of the sampled prompts)
    records: int  # every record of the run
    largest_budget: int  # the budget phase 1 decoded
    chosen_budget: int
    why: str
    compared: int  # records where DDTree was checked against an exact method (temperature 0)
    matched: int  # of them, those whose tokens were equal
    predicted_speedup: float | None  # the chosen budget's speedup as phase 1 predicted it (None: no prediction)
    sample_speedup: float  # and as measured on the sample, paired with AR on the same records
    restored: bool = False  # phase 1 was an earlier run's, stopped in phase 2 (`phase_one_state`)

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "line": self.line()}

    def metrics(self) -> dict[str, float]:
        figures = {
            "protocol.chosen_budget": float(self.chosen_budget),
            "protocol.sample_records": float(self.sample_records),
            "protocol.records": float(self.records),
            "protocol.sample_speedup_vs_ar": self.sample_speedup,
        }
        if self.predicted_speedup is not None:
            figures["protocol.predicted_speedup_vs_ar"] = self.predicted_speedup
        if self.compared:
            figures["protocol.ddtree_matches"] = self.matched / self.compared
        return figures

    def line(self) -> str:
        text = (
            f"two phases: {counted(self.sample_records, 'record')} of {self.records} sampled (every "
            f"{self.every}) for AR, DFlash and DDTree {self.largest_budget}"
            f"{' (restored from a stopped run of these settings)' if self.restored else ''}; then DFlash and DDTree "
            f"{self.chosen_budget} on every record ({self.why})"
        )
        text += f"; on the sample it ran ×{self.sample_speedup:.2f} vs AR"
        if self.predicted_speedup is not None:
            text += f" (predicted ×{self.predicted_speedup:.2f})"
        if self.compared:
            text += f"; DDTree's tokens equal the exact reference's on {self.matched} of {self.compared}"
        return text


def run_phase_2(
    log: EventLog,
    loop: RecordLoop,
    prompts: list[Prompt],
    encoded: list[Any],
    indices: list[int],
    phase_1: dict[int, list[tuple[Turn, PromptRun]]],
    tallies: Tallies,
    progress: Progress,
    prediction: Prediction | None,
    protocol: Protocol,
    compile_round: Callable[[Method], None],
    announce_params: Callable[[Method, int], None],
    *,
    restored: bool = False,
) -> tuple[Tallies, PhaseTwo]:
    """Phase 2 over every record (the module's); returns the sample's tallies with the chosen budget added (what
    the run's figures are, paired with AR), and what phase 2 did."""
    first = tallies.comparison.methods
    largest = max(m.budget for m in first if m.name == "ddtree")
    choice: Choice = choose_budget(prediction, largest)
    LOG.info("phase 2: DFlash and DDTree %d on every record (%s)", choice.budget, choice.why)
    chosen = Method(f"ddtree_tb{choice.budget}", "ddtree", choice.budget)
    dflash = next(m for m in first if m.name == "dflash")
    sampled = sum(len(turns) for turns in phase_1.values())
    records = sum(p.turns for p in prompts)
    announce_params(chosen, len(prompts))
    final = tallies
    if chosen.scope not in tallies.comparison.tallies:
        compile_round(chosen)
        final = Tallies.of([*first, chosen], loop.settings, loop.target.dtype)
    others = Tallies.of([dflash, chosen], loop.settings, loop.target.dtype)
    progress.records_done = 0
    compared = matched = 0
    for position, prompt in enumerate(prompts):
        if position not in phase_1:
            for _turn, run in loop.turns(prompt, encoded[position], indices[position], [dflash, chosen], others,
                                         progress, phase="phase 2 · ", extra={"phase": 2}):  # fmt: skip
                if others.comparison.exactness:
                    compared += 1
                    matched += run.first(chosen.scope).tokens == run.first(dflash.scope).tokens
            continue
        for turn, run in phase_1[position]:
            if final is tallies:  # the chosen budget is the one phase 1 decoded: its figures are in
                progress.records_done += 1
                continue
            label = f" ({prompt.turn_id(turn.turn)})" if turn.turn > 1 else ""
            extra = loop.decode(turn, [chosen], progress.announcer(final, label, "phase 2 · "))
            merged = PromptRun(run.index, run.tokens, run.prefill_target_seconds, run.prefill_draft_seconds,
                               {**run.results, **extra.results})  # fmt: skip
            divergences = final.add(merged)
            loop.write_row(prompt, turn, merged, [chosen], divergences, final.comparison, {"phase": 2})
            progress.records_done += 1
    if final.comparison.exactness:  # the sample: the chosen budget against AR
        tally = final.comparison.tallies[chosen.scope]
        compared, matched = compared + tally.prompts, matched + tally.matches
    predicted = None
    if prediction is not None and choice.budget <= len(prediction.budgets):
        predicted = prediction.tokens_per_s[choice.budget - 1] / prediction.ar_predicted_tokens_per_s
    measured = final.comparison.metrics()[chosen.scope]["speedup_vs_ar"]
    return final, PhaseTwo(
        protocol.kind, protocol.every, sampled, records, largest, choice.budget, choice.why, compared, matched,
        predicted, measured, restored,
    )  # fmt: skip
