"""The decode experiment's loop over records: a prompt's turns, each decoded by a list of methods, tallied and
written to `generations.jsonl` as it ends.

`ddtree_gdn` runs it once over every record (the grid protocol), or twice (`decoding.two_phase`): phase 1's
methods over the sample, then phase 2's over every record. A turn of a multi-turn prompt continues from the
last method's answer to the turn before; phase 2 decodes a sampled conversation's later turns from the very
prompts phase 1 decoded (`Turn`), so that both phases' figures of one record are of the same input.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from remote_worker import stop_signal
from remote_worker.decoding.acceptance_profile import AcceptanceProfile
from remote_worker.decoding.budget_curve import BudgetCurve
from remote_worker.decoding.comparison import Comparison, Method, PromptRun, Settings, run_prompt
from remote_worker.decoding.compiled import CompiledRounds
from remote_worker.decoding.online_budget import OnlineBudget
from remote_worker.events import EventLog
from remote_worker.experiments.decode_report import generation_row
from remote_worker.models.target import TargetModel
from remote_worker.prompt_set import Prompt
from remote_worker.prompts import decode_text, encode

LOG = logging.getLogger(__name__)

# A later turn's record index: the prompt's index plus this per turn, so every record of a set has its own
# sampling seed (`prompt_seed`) whichever shard decodes it.
TURN_INDEX_STRIDE = 1_000_000


@dataclass(frozen=True)
class Turn:
    """One record: a turn of a prompt, its index (the sampling seed's) and the prompt as the model saw it."""

    turn: int
    record: int
    conversation: Prompt
    ids: torch.Tensor


@dataclass
class Tallies:
    """What a pass over records adds up: the methods' comparison, acceptance profiles and budget curves."""

    comparison: Comparison
    profiles: dict[str, AcceptanceProfile] = field(default_factory=dict)
    curves: dict[str, BudgetCurve] = field(default_factory=dict)

    @classmethod
    def of(cls, methods: list[Method], settings: Settings, dtype: torch.dtype) -> Tallies:
        return cls(
            Comparison(methods, settings.temperature, dtype),
            {m.scope: AcceptanceProfile() for m in methods if m.drafts},
            {m.scope: BudgetCurve(m.budget) for m in methods if m.name == "ddtree"},
        )

    def add(self, run: PromptRun) -> dict[str, Any]:
        divergences = self.comparison.add(run)
        for scope, profile in self.profiles.items():
            profile.add(run.first(scope).accepted_ranks)
        for scope, curve in self.curves.items():
            curve.add(run.first(scope).accepted_nodes)
        return divergences


@dataclass
class Progress:
    """The `decode` progress line over all the decodes a run makes (a record × a method × a pass)."""

    log: EventLog
    total: int
    records: int
    done: int = 0
    records_done: int = 0

    def announcer(self, tallies: Tallies, label: str, phase: str) -> Callable[[Method, int], None]:
        def announce(method: Method, repeat: int) -> None:
            stop_signal.check()
            comparison = tallies.comparison
            tau, speed = comparison.tau_so_far(method.scope), comparison.tokens_per_s_so_far(method.scope)
            message = f"{phase}{method.scope} · prompt {self.records_done + 1}/{self.records}{label}"
            message += (f" · tau {tau:.2f}" if tau else "") + (f" · {speed:.0f} tok/s" if speed else "")
            self.log.progress("decode", self.done, self.total, message)
            self.done += 1

        return announce


@dataclass
class RecordLoop:
    """Everything a record's decode reads but its methods: the pair, the tokenizer, the settings, the compiled
    rounds, and the file each record's row is written to."""

    target: TargetModel
    drafter: Any
    tokenizer: Any
    settings: Settings
    thinking: bool
    compiled: CompiledRounds | None
    generations: IO[str]
    check_fits: Callable[[torch.Tensor, Prompt], None]
    online: dict[str, OnlineBudget] = field(default_factory=dict)  # `ddtree_online`'s policy, by scope

    def turns(
        self,
        prompt: Prompt,
        first_ids: torch.Tensor,
        index: int,
        methods: list[Method],
        tallies: Tallies,
        progress: Progress,
        *,
        known: list[Turn] | None = None,
        phase: str = "",
        extra: dict[str, Any] | None = None,
    ) -> Iterator[tuple[Turn, PromptRun]]:
        """Each turn of `prompt` decoded by `methods`, tallied and written (a row with `extra`'s keys), yielded
        after; `known`: the turns as an earlier phase decoded them (their prompts are reused, not rebuilt)."""
        vocab = self.target.embed.num_embeddings
        conversation, ids, answer = prompt, first_ids, []
        for turn in range(1, prompt.turns + 1):
            if known is not None:
                conversation, ids = known[turn - 1].conversation, known[turn - 1].ids
            elif turn > 1:  # the last method's answer to the turn before is the history every method continues
                conversation = conversation.next_turn(decode_text(answer, self.tokenizer, skip_special=True))
                ids = encode(conversation, self.tokenizer, vocab, self.thinking)
                self.check_fits(ids, conversation)
            record = index + (turn - 1) * TURN_INDEX_STRIDE
            label = f" ({prompt.turn_id(turn)})" if turn > 1 else ""
            announce = progress.announcer(tallies, label, phase)
            run = self.decode(Turn(turn, record, conversation, ids), methods, announce)
            divergences = tallies.add(run)
            done = Turn(turn, record, conversation, ids)
            self.write_row(prompt, done, run, methods, divergences, tallies.comparison, extra)
            progress.records_done += 1
            answer = run.first(methods[-1].scope).tokens
            yield done, run

    def decode(self, turn: Turn, methods: list[Method], announce: Callable[[Method, int], None]) -> PromptRun:
        """One record as it was: `turn`'s prompt decoded by `methods`."""
        rounds, prefiller = (self.compiled.rounds, self.compiled.prefiller) if self.compiled else (None, None)
        return run_prompt(
            self.target, self.drafter, turn.ids, methods, self.settings, turn.record, announce, rounds, prefiller,
            self.online,
        )  # fmt: skip

    def write_row(
        self,
        prompt: Prompt,
        turn: Turn,
        run: PromptRun,
        methods: list[Method],
        divergences: dict[str, Any],
        comparison: Comparison,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """The record's row of `generations.jsonl`: `methods`' outputs, each compared with the comparison's
        reference (AR, or DFlash where phase 2 decodes no AR)."""
        reference = comparison.methods[0].name
        row = generation_row(
            turn.conversation, run, methods, divergences, self.tokenizer, comparison.exactness, reference
        )
        row.update(id=prompt.turn_id(turn.turn), turn=turn.turn, index=turn.record, **(extra or {}))
        # ASCII-escaped: a generation holds whatever the prompt and the model wrote (U+2028, NUL, …), and every
        # reader, `str.splitlines` too, must find one record a line
        self.generations.write(json.dumps(row, ensure_ascii=True) + "\n")
        self.generations.flush()
