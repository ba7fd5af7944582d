"""Phase 1 of a two-phase decode, kept, so that a sweep stopped between the phases resumes phase 2 only.

Phase 1 is most of a two-phase job's GPU time (AR decodes one token a step, DDTree at the largest budget pays
for its biggest trees). When it ends the worker writes `phase_1.json` whole (a rename) and lists it as an
artifact; the orchestrator signs it as it receives it (`orchestrator.tracking.signing.phase_1_signature`). A
sweep run again after the job was stopped hands a verified phase 1 of that run, same settings, to the job's new
run (`experiment.phase_1_file`), which restores it (`restore`) in place of decoding the sample again: its rows
written again, its tallies, its round costs, then phase 2 as usual.

What the file holds: per sampled record its token ids and every method's `DecodeResult`, the round costs, and
the two things the budget prediction read from the host besides (`compiled`, `free`), so that the prediction
and the choice computed again from them are phase 1's own. A file that does not describe this run's sample —
other records, prompts that encode to other ids (another tokenizer), other methods or repeats — is set aside
with a warning and phase 1 decoded again: that costs time, never a wrong figure.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from remote_worker.decoding.comparison import Method, PromptRun
from remote_worker.decoding.loop import DecodeResult
from remote_worker.decoding.node_cost import NodeCosts, StageCost
from remote_worker.decoding.round_times import RoundTimes
from remote_worker.decoding.two_phase import PHASE_1_FILE as PHASE_1_FILE
from remote_worker.experiments.record_loop import TURN_INDEX_STRIDE, Turn
from remote_worker.prompt_set import Prompt
from remote_worker.prompts import decode_text, encode

FORMAT = 1


@dataclass(frozen=True)
class PhaseOne:
    """Phase 1 as phase 2 reads it: each sampled position's turns as decoded, the costs, the host's facts."""

    turns: dict[int, list[tuple[Turn, PromptRun]]]  # position in the run's prompts -> its turns, in order
    costs: NodeCosts | RoundTimes | None
    compiled: bool  # its rounds were compiled (the prediction checks its costs against that)
    free: int | None  # the bytes free for the decode that the prediction's memory check read


def encoded_state(
    methods: list[Method],
    repeats: int,
    turns: dict[int, list[tuple[Turn, PromptRun]]],
    costs: NodeCosts | RoundTimes | None,
    compiled: bool,
    free: int | None,
) -> bytes:
    """`phase_1.json`'s bytes."""
    records = [
        {"position": position, "turn": turn.turn, "record": turn.record, "ids": turn.ids.tolist(), "run": _run(run)}
        for position, decoded in sorted(turns.items())
        for turn, run in decoded
    ]
    document = {
        "format": FORMAT,
        "methods": [m.scope for m in methods],
        "repeats": repeats,
        "records": records,
        "costs": costs.as_record() if costs is not None else None,
        "compiled": compiled,
        "free": free,
    }
    return (json.dumps(document, ensure_ascii=True, separators=(",", ":")) + "\n").encode()


@dataclass(frozen=True)
class Encoder:
    """What rebuilds a record's prompt as the record loop built it (`RecordLoop.turns`)."""

    tokenizer: Any
    vocab: int
    thinking: bool


def restore(
    data: bytes,
    encoder: Encoder,
    methods: list[Method],
    repeats: int,
    prompts: list[Prompt],
    encoded: list[Any],
    indices: list[int],
    sample: list[int],
) -> PhaseOne | str:
    """The phase 1 that `data` holds, checked against this run's sample (each turn's prompt rebuilt as the
    record loop builds it and encoded again: the ids must be the ones decoded); or why it cannot stand for it."""
    try:
        document = json.loads(data)
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            return f"it is not a phase-1 file of format {FORMAT}"
        if document.get("methods") != [m.scope for m in methods]:
            return f"it holds the methods {document.get('methods')}, this run's phase 1 {[m.scope for m in methods]}"
        if document.get("repeats") != repeats:
            return f"it was decoded with {document.get('repeats')} repeats, this run {repeats}"
        by_position: dict[int, list[dict[str, Any]]] = {}
        for record in document["records"]:
            by_position.setdefault(int(record["position"]), []).append(record)
        if sorted(by_position) != sorted(sample):
            return "it holds other records than this run's sample"
        turns = {}
        for position in sample:
            found = _turns(
                by_position[position], encoder, methods, prompts[position], encoded[position], indices[position]
            )
            if isinstance(found, str):
                return f"record {prompts[position].id!r}: {found}"
            turns[position] = found
        costs = _costs(document["costs"]) if document.get("costs") is not None else None
        free = document.get("free")
        return PhaseOne(turns, costs, bool(document["compiled"]), int(free) if free is not None else None)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"it cannot be read ({type(exc).__name__}: {str(exc)[:200]})"


def _turns(
    records: list[dict[str, Any]], encoder: Encoder, methods: list[Method], prompt: Prompt, first_ids: Any, index: int
) -> list[tuple[Turn, PromptRun]] | str:
    """One sampled prompt's turns, each prompt as `RecordLoop.turns` builds it from the answer before."""
    if [int(r["turn"]) for r in records] != list(range(1, prompt.turns + 1)):
        return f"it holds turns {[r['turn'] for r in records]} of a prompt of {prompt.turns}"
    conversation, ids, answer, found = prompt, first_ids, [], []
    for record in records:
        turn = int(record["turn"])
        if turn > 1:
            conversation = conversation.next_turn(decode_text(answer, encoder.tokenizer, skip_special=True))
            ids = encode(conversation, encoder.tokenizer, encoder.vocab, encoder.thinking)
        if ids.tolist() != record["ids"]:
            return f"turn {turn} encodes to other token ids than the ones phase 1 decoded"
        if int(record["record"]) != index + (turn - 1) * TURN_INDEX_STRIDE:
            return f"turn {turn} is record {record['record']}, not {index + (turn - 1) * TURN_INDEX_STRIDE}"
        run = _prompt_run(record["run"])
        if set(run.results) != {m.scope for m in methods} or run.tokens != ids.tolist():
            return f"turn {turn}'s decode is not of this run's methods and prompt"
        found.append((Turn(turn, int(record["record"]), conversation, ids), run))
        answer = run.first(methods[-1].scope).tokens
    return found


def _run(run: PromptRun) -> dict[str, Any]:
    return {
        "index": run.index,
        "tokens": list(run.tokens),
        "prefill_target_seconds": run.prefill_target_seconds,
        "prefill_draft_seconds": run.prefill_draft_seconds,
        "results": {scope: [asdict(result) for result in results] for scope, results in run.results.items()},
    }


def _prompt_run(record: dict[str, Any]) -> PromptRun:
    results = {str(scope): [_result(r) for r in results] for scope, results in dict(record["results"]).items()}
    return PromptRun(
        int(record["index"]), [int(t) for t in record["tokens"]], float(record["prefill_target_seconds"]),
        float(record["prefill_draft_seconds"]), results,
    )  # fmt: skip


def _result(record: dict[str, Any]) -> DecodeResult:
    fields = dict(record)
    fields["margins"] = [tuple(pair) for pair in fields.get("margins", [])]
    return DecodeResult(**fields)


def _costs(record: dict[str, Any]) -> NodeCosts | RoundTimes:
    if record.get("kind") == "compiled":
        return RoundTimes(
            sizes=[int(s) for s in record["sizes"]],
            rounds=[StageCost.from_record(r) for r in record["rounds"]],
            repeats=int(record["repeats"]),
            device=str(record["device"]),
            context=int(record["context"]),
        )
    return NodeCosts.from_record(record)
