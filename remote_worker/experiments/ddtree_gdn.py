"""`experiment=ddtree_gdn`: AR, DFlash and DDTree at every tree budget over a prompt set, one child run each;
or, with `decode.protocol=two_phase`, AR, DFlash and the largest budget over a sample of it, then DFlash and
the budget the sample predicts fastest over all of it (`decoding.two_phase`, `experiments.phase_two`).

Target and draft are loaded once and every prompt is encoded (and checked against the model's context)
before anything is decoded. Each prompt is then prefilled once and decoded by every method from that
state, `decode.repeats` times, the methods taking turns (see `remote_worker.decoding.comparison`). At the
end each method reports its figures, then its per-round acceptance series, under its own scope (`ar`,
`dflash`, `ddtree_tb32`, …); while it runs, progress events carry its tau and speed so far.
`generations.jsonl` holds a row per record with every method's output; `decode_summary.json` carries what
the orchestrator plots.

A record is one turn of one conversation: a multi-turn prompt (MT-Bench) is decoded turn by turn, each turn a
record; before the next turn the last method's answer (special tokens skipped) becomes the assistant's turn,
so every method decodes turn 2 from the same history. `experiment.shard=i/n` decodes prompts i, i+n, … of
the set (after `num_prompts`); a record keeps its index in the whole set, which seeds its sampling, so the
shards of a set decode exactly the records the whole set would.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from remote_worker import host_load, stop_signal
from remote_worker.decoding import peak_memory
from remote_worker.decoding.comparison import Method, PromptRun, Settings, methods_for, run_prompt
from remote_worker.decoding.compile_cache import CompileCache
from remote_worker.decoding.compiled import CompiledRounds, add_round, compile_rounds, wanted
from remote_worker.decoding.figure_rules import ONLINE
from remote_worker.decoding.node_cost import NodeCosts
from remote_worker.decoding.online_budget import OnlineBudget
from remote_worker.decoding.tree_memory import free_bytes
from remote_worker.decoding.two_phase import sample_positions
from remote_worker.events import EventLog
from remote_worker.experiments.budget_answer import (
    NodeCostSlices,
    budget_curve_record,
    check_budgets,
    emit_budget_curves,
    predict_budget,
)
from remote_worker.experiments.decode_report import (
    GENERATIONS_FILE,
    SUMMARY_FILE,
    emit_rounds,
    headline_first,
    headline_metrics,
    terminal_summary,
    write_summary,
)
from remote_worker.experiments.phase_one_state import PHASE_1_FILE, Encoder, PhaseOne, encoded_state, restore
from remote_worker.experiments.phase_two import protocol_of, run_phase_2
from remote_worker.experiments.record_loop import Progress, RecordLoop, Tallies, Turn
from remote_worker.experiments.verdict import best_tags
from remote_worker.figures import rounded
from remote_worker.models.layout import layout_params
from remote_worker.models.loading import (
    context_length,
    load_drafter,
    load_model,
    load_tokenizer,
    model_prompts,
    stop_token_ids,
)
from remote_worker.models.target import TargetModel
from remote_worker.prompt_set import DEFAULT_PROMPTS, Prompt, load_prompt_file
from remote_worker.prompts import encode
from remote_worker.safe_files import Folder
from remote_worker.spec import Spec
from remote_worker.wording import counted

LOG = logging.getLogger(__name__)


def prompt_source(spec: Spec) -> Path:
    """The run's own copy of its prompt set when the orchestrator sent one, else the prompts the checkpoint
    ships (a trained fixture's held-out set), else the small set shipped with the worker."""
    if spec.experiment.get("prompts_file"):
        return spec.run_dir / str(spec.experiment["prompts_file"])
    shipped = model_prompts(spec.model)
    return Path(shipped) if shipped else DEFAULT_PROMPTS


def shard_of(value: Any) -> tuple[int, int]:
    """`experiment.shard` as (i, n): "i/n" with 0 <= i < n; null is the whole set, (0, 1)."""
    if value is None:
        return 0, 1
    part, _, count = str(value).partition("/")
    i, n = int(part), int(count)
    if not 0 <= i < n:
        raise ValueError(f"experiment.shard={value!r} must be i/n with 0 <= i < n")
    return i, n


def check_fits(
    ids: torch.Tensor, prompt: Prompt, target: TargetModel, max_new_tokens: int, name: str, overhang: int
) -> None:
    """A prompt that leaves no room for the new tokens (and the `overhang` a last round's draft block or tree may
    reach past them) is an error naming the prompt, the model's context and the fix."""
    limit = context_length(target.model)
    needed = ids.shape[0] + max_new_tokens + overhang
    if limit is None or needed <= limit:
        return
    extra = f" and {overhang} for a round's draft or tree (decode.tree_budgets)" if overhang else ""
    room = limit - ids.shape[0] - overhang
    fix = (
        f"lower decode.max_new_tokens to at most {room}" if room >= 1
        else "that prompt alone does not fit: shorten it or leave it out of the prompt set"
    )  # fmt: skip
    raise ValueError(
        f"prompt {prompt.id!r} has {ids.shape[0]} tokens: with decode.max_new_tokens={max_new_tokens}{extra} "
        f"it needs {needed} positions, more than model {name}'s context of {limit}; {fix}"
    )


# Room for a later turn's answer as re-encoded text: the template's own tokens around it and a tokenization
# that does not split the text back into the very tokens that were decoded.
TURN_MARGIN = 32


def longest_prompt(
    prompts: list[Prompt], encoded: list[torch.Tensor], tokenizer: Any, vocab: int, thinking: bool, new: int
) -> int:
    """The longest prompt any record decodes from: a first turn's ids, or for a multi-turn conversation its
    every turn with answers of up to `new` tokens (each with TURN_MARGIN), which sizes the compiled rounds and
    the memory check before the first turn is decoded."""
    longest = 0
    for prompt, ids in zip(prompts, encoded, strict=True):
        if prompt.followups:
            whole = prompt
            while whole.followups:
                whole = whole.next_turn("")
            bound = len(encode(whole, tokenizer, vocab, thinking)) + len(prompt.followups) * (new + TURN_MARGIN)
            longest = max(longest, bound)
        longest = max(longest, len(ids))
    return longest


def encode_all(
    prompts: list[Prompt],
    tokenizer: Any,
    target: TargetModel,
    max_new_tokens: int,
    enable_thinking: bool,
    name: str,
    overhang: int = 0,
) -> list[torch.Tensor]:
    """Every prompt's token ids; a prompt that leaves no room for the new tokens (and the `overhang` a last
    round's draft block or tree may reach past them) is an error, before anything is decoded."""
    encoded = []
    for prompt in prompts:
        ids = encode(prompt, tokenizer, target.embed.num_embeddings, enable_thinking)
        check_fits(ids, prompt, target, max_new_tokens, name, overhang)
        encoded.append(ids)
    return encoded


def load_pair(spec: Spec, log: EventLog) -> tuple[Any, TargetModel, Any]:
    """The target (the transformers model and its wrapper) and its drafter, the layout's params logged (a
    warning when no tested model shares it), `decode.block_size` applied to the drafter."""
    log.progress("setup", 0, 2, f"loading {spec.model.name} and its draft")
    started = time.perf_counter()
    model = load_model(spec.model, spec.seed)
    target = TargetModel(model)
    drafter = load_drafter(spec.model, spec.seed, model)
    LOG.info(
        "loaded %s (%s, %s) and its draft in %.1f s",
        spec.model.name, str(target.dtype).removeprefix("torch."), target.device, time.perf_counter() - started,
    )  # fmt: skip
    params, uncovered = layout_params(model, drafter.config.to_dict(), spec.model.source == "pretrained")
    log.emit("params", params)
    if uncovered:
        LOG.warning("%s", uncovered)
    if spec.decode.get("block_size"):
        drafter.block_size = int(spec.decode["block_size"])
    return model, target, drafter


def run_ddtree_gdn(spec: Spec, log: EventLog) -> dict[str, str]:
    protocol = protocol_of(spec.decode)  # a bad setting is one line before the model loads
    online_wanted = bool(spec.decode.get("online_budget", False))
    if online_wanted and protocol.two_phase:
        raise ValueError("decode.online_budget=true needs decode.protocol=grid (two phases decode one chosen budget)")
    model, target, drafter = load_pair(spec, log)
    tokenizer = load_tokenizer(spec.model)
    settings = Settings(
        max_new_tokens=int(spec.decode.get("max_new_tokens", 64)),
        temperature=float(spec.decode.get("temperature", 0.0)),
        repeats=int(spec.decode.get("repeats", 1)),
        stop_tokens=stop_token_ids(model, tokenizer),
        seed=spec.seed,
    )
    whole = load_prompt_file(prompt_source(spec), spec.experiment.get("num_prompts"))
    shard, shards = shard_of(spec.experiment.get("shard"))
    prompts, indices = whole[shard::shards], list(range(len(whole)))[shard::shards]
    if not prompts:
        has = counted(len(whole), "prompt")
        raise ValueError(f"experiment.shard={shard}/{shards} holds no prompt: the set has {has}")
    records = sum(prompt.turns for prompt in prompts)
    enable_thinking = bool(spec.experiment.get("enable_thinking", False))
    budgets = [int(b) for b in spec.decode.get("tree_budgets", [16, 32, 64])]
    overhang = max(drafter.block_size, max(budgets) + 1)  # a last round's draft block, or its tree's nodes
    encoded = encode_all(
        prompts, tokenizer, target, settings.max_new_tokens, enable_thinking, spec.model.name, overhang
    )
    vocab = target.embed.num_embeddings
    longest_ids = longest_prompt(prompts, encoded, tokenizer, vocab, enable_thinking, settings.max_new_tokens)
    longest = longest_ids + settings.max_new_tokens
    free = free_bytes(target.device)
    check_budgets(target, drafter.block_size, budgets, longest, free)
    largest = max(budgets)
    # Two-phase: phase 1's methods on the sample; grid: every method on every record
    methods = methods_for([largest] if protocol.two_phase else budgets, online=online_wanted)
    online = {m.scope: OnlineBudget.for_budgets(budgets) for m in methods if m.name == ONLINE}
    passes = f" × {settings.repeats} repeats" if settings.repeats > 1 else ""
    turns = f" ({counted(records, 'turn')})" if records != len(prompts) else ""
    of_shard = f" (shard {shard}/{shards})" if shards > 1 else ""
    log.progress(
        "setup", 2, 2, f"{counted(len(prompts), 'prompt')}{turns}{of_shard} × {counted(len(methods), 'method')}{passes}"
    )
    compiled = _compiled_rounds(spec, log, target, drafter, methods, encoded, settings, longest_ids, online)
    for scope in online if compiled is not None else ():  # the compiled round's policy: the captured sizes
        online[scope] = compiled.rounds[scope].policy
    if compiled is None:
        _warm_up(target, drafter, encoded[0], methods)
    sample = sample_positions(len(prompts), protocol.every) if protocol.two_phase else list(range(len(prompts)))
    sampled = sum(prompts[p].turns for p in sample)
    restored = None
    if protocol.two_phase and spec.experiment.get("phase_1_file"):
        encoder = Encoder(tokenizer, vocab, enable_thinking)
        restored = _handed_phase_1(spec, encoder, methods, settings.repeats, prompts, encoded, indices, sample)
    slices = None if restored is not None else NodeCostSlices.of(
        spec, target, drafter, len(sample), settings, budgets, compiled
    )  # fmt: skip
    context = _job_context(spec, target, prompts)
    for method in methods:
        params = {**context, **_method_params(method, drafter.block_size, settings, len(sample), compiled is not None)}
        log.emit("params", params, scope=method.scope)
    tallies = Tallies.of(methods, settings, target.dtype)
    # Phase 2 (two-phase only) decodes DFlash on the records outside the sample and the chosen budget on all
    total = sampled * len(methods) * settings.repeats
    if protocol.two_phase:
        total += (2 * records - sampled) * settings.repeats
    progress = Progress(log, total, records)
    load = host_load.running()
    decode_started = time.time()
    phase_1: dict[int, list[tuple[Turn, PromptRun]]] = {}
    with os.fdopen(Folder(spec.run_dir).open_new(GENERATIONS_FILE), "w", encoding="utf-8") as generations:

        def fits(ids: torch.Tensor, conversation: Prompt) -> None:
            check_fits(ids, conversation, target, settings.max_new_tokens, spec.model.name, overhang)

        loop = RecordLoop(target, drafter, tokenizer, settings, enable_thinking, compiled, generations, fits, online)
        marks = {"phase": 1} if protocol.two_phase else {}
        if restored is not None:  # phase 1's rows written again from what it decoded, its tallies added up
            phase_1 = restored.turns
            for position in sample:
                for turn, run in phase_1[position]:
                    divergences = tallies.add(run)
                    loop.write_row(prompts[position], turn, run, methods, divergences, tallies.comparison, marks)
                    progress.records_done += 1
                    progress.done += len(methods) * settings.repeats
        for slot, position in enumerate(sample if restored is None else []):
            decoded = list(
                loop.turns(prompts[position], encoded[position], indices[position], methods, tallies, progress,
                           phase="phase 1 · " if protocol.two_phase else "", extra=marks)
            )  # fmt: skip
            if slices is not None:
                slices.after(slot, decoded[0][0].ids, log)
                costs_now = slices.sampler.costs() if online and slot in slices.points else None
                for policy in online.values():  # the costs as measured so far, for the next rounds' choices
                    if isinstance(costs_now, NodeCosts):
                        policy.measured(costs_now)
            phase_1[position] = decoded
        summary = tallies.comparison.metrics()
        costs = restored.costs if restored is not None else slices.costs() if slices is not None else None
        was_compiled = restored.compiled if restored is not None else compiled is not None
        if restored is not None:
            free = restored.free
        if protocol.two_phase:  # kept, so that a sweep stopped in phase 2 resumes there (`phase_one_state`)
            state = encoded_state(methods, settings.repeats, phase_1, costs, was_compiled, free)
            Folder(spec.run_dir).write_whole(PHASE_1_FILE, state)
            log.emit("artifact", {"path": PHASE_1_FILE})
        withheld = None  # why the rounds cannot tell the budgets apart (only DDTree has budgets to tell)
        if any(m.name == "ddtree" for m in methods):
            withheld = curve_withheld(int(spec.decode.get("max_new_tokens", 0)), drafter.block_size)
        curve = prediction = None
        if withheld is None:
            curve = budget_curve_record(methods, tallies.curves, summary)
            prediction = predict_budget(
                methods, tallies.curves, costs, summary, compiled=was_compiled, target=target,
                context=longest, free=free, prompts=sampled,
                measured_by="phase 1" if protocol.two_phase else "the run",
            )  # fmt: skip
        else:
            LOG.warning("no budget curve and no budget prediction: %s, so no round could hold a whole tree", withheld)
        phase_2 = None
        if protocol.two_phase:

            def compile_round(method: Method) -> None:
                if compiled is not None:
                    _compile_one_more(log, compiled, target, drafter, method, encoded[0], settings)

            def announce_params(method: Method, count: int) -> None:
                params = _method_params(method, drafter.block_size, settings, count, compiled is not None)
                log.emit("params", {**context, **params}, scope=method.scope)

            tallies, phase_2 = run_phase_2(
                log, loop, prompts, encoded, indices, phase_1, tallies, progress, prediction, protocol,
                compile_round, announce_params, restored=restored is not None,
            )  # fmt: skip
            summary = tallies.comparison.metrics()
            methods = tallies.comparison.methods
    log.progress("decode", total, total, "done")
    compile_figures = _compile_figures(compiled, summary)
    # A run page lists metrics in the order they were first logged (see HEADLINE_FIRST): the answer first.
    headline, verdict = headline_metrics(summary)
    best = {key: value for key, value in headline.items() if key.startswith("best.")}
    predicted = prediction.metrics() if prediction is not None else {}
    if phase_2 is not None:
        predicted.update(phase_2.metrics())
    log.emit("metrics", rounded({**best, **predicted, **headline}), step=0)  # the job's run answers
    if compile_figures:
        log.emit("metrics", rounded(compile_figures), step=0)
    for scope, metrics in summary.items():
        log.emit("metrics", rounded(headline_first(metrics)), scope=scope, step=0)
    emit_budget_curves(log, curve, costs, prediction)
    for scope, tally in tallies.comparison.tallies.items():
        emit_rounds(log, scope, tally.acceptance_lengths)
    for scope, policy in online.items():  # the chosen budgets as a histogram: rounds (value) at budget (step)
        for budget, count in sorted(policy.verified.items()):
            log.emit("metrics", {"rounds_at_budget": float(count)}, scope=scope, step=budget)
    if verdict is not None:
        log.emit("tags", best_tags(verdict, methods))
    extras = {
        "budget_curve": curve,
        "curve_withheld": withheld,
        "node_costs": costs.as_record() if costs is not None else None,
        "prediction": prediction.as_record() if prediction is not None else None,
        "acceptance_profiles": {scope: profile.as_record() for scope, profile in tallies.profiles.items()},
        "peak_memory_measures": peak_memory.measures(target.device),
        "host_load": load.summary(since=decode_started).as_record() if load is not None else None,
        "protocol": phase_2.as_record() if phase_2 is not None else {"kind": "grid"},
        "online_budget": {scope: policy.as_record() for scope, policy in online.items()} or None,
    }
    write_summary(spec, methods, summary, tallies.comparison, str(target.device), drafter.block_size, verdict, extras)
    log.emit("artifact", {"path": SUMMARY_FILE})
    log.emit("artifact", {"path": GENERATIONS_FILE})
    lines = terminal_summary(summary, verdict)
    if prediction is not None:
        lines["budget"] = prediction.line()
    elif withheld is not None:
        lines["budget"] = f"not predicted: {withheld}, so no round could hold a whole tree"
    if phase_2 is not None:
        lines["protocol"] = phase_2.line()
    return lines


def _handed_phase_1(
    spec: Spec,
    encoder: Encoder,
    methods: list[Method],
    repeats: int,
    prompts: list[Prompt],
    encoded: list[torch.Tensor],
    indices: list[int],
    sample: list[int],
) -> PhaseOne | None:
    """The phase 1 the orchestrator handed over (`experiment.phase_1_file`: an earlier run's, with these settings,
    stopped in phase 2), checked against this run's sample; None, with a warning, where it cannot stand for it."""
    name = str(spec.experiment["phase_1_file"])
    data = Folder(spec.run_dir).read(name)
    found = restore(data, encoder, methods, repeats, prompts, encoded, indices, sample) if data is not None else None
    if not isinstance(found, PhaseOne):
        why = found or f"{name} is not in the run folder"
        LOG.warning("phase 1 of an earlier run is not used, so it is decoded again: %s", why)
        return None
    LOG.info("phase 1: restored from an earlier run with these settings (%s); phase 2 only", counted(
        sum(len(turns) for turns in found.turns.values()), "record"))  # fmt: skip
    return found


def curve_withheld(max_new_tokens: int, block_size: int) -> str | None:
    """Why a decode's rounds cannot tell tau at every budget, or None where they can. A decode shorter than one
    draft block ends before any round could hold a whole tree: its rounds accept what the remaining tokens
    allow, whatever the budget, so the curve read from them is flat (a run of 8 new tokens at block 16 drew
    tau 1.00 at budget 64 where its decode at 64 measured 4.00), and so are the predictions built on it."""
    if 0 < max_new_tokens < block_size:
        return f"decode.max_new_tokens={max_new_tokens} is shorter than a draft block ({block_size})"
    return None


def _warm_up(target: TargetModel, drafter: Any, prompt: torch.Tensor, methods: list[Method]) -> None:
    """Every method decodes a few tokens of the first prompt, untimed, before any clock: a process's first
    decodes can pay for what it sets up once (the allocator's pools, the first call into each kernel; on CUDA
    its handles and module loads). On the trained pair on a CPU the effect was small and irregular: two runs
    without it put the first prompt's rounds 0 to 28 % above the others'. Compiled rounds warm up as they
    compile."""
    run_prompt(target, drafter, prompt[:32], methods, Settings(8), index=0)


def _compile_figures(compiled: CompiledRounds | None, summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """The job's compile figures (`compile_s`, `prefill.compile_s`, `recompiles`), each method's `compile_s`
    added to its figures; none for a run decoded eagerly."""
    if compiled is None:
        return {}
    for scope, seconds in compiled.compile_seconds.items():
        if scope in summary:  # the methods' rounds; "prefill" is the job's
            summary[scope]["compile_s"] = seconds
    recompiles = compiled.recompiles()
    if recompiles:
        LOG.warning("decode.compile: %d graphs were compiled again after the warm-up (a shape changed)", recompiles)
    return {
        "compile_s": sum(compiled.compile_seconds.values()),
        "prefill.compile_s": compiled.compile_seconds["prefill"],
        "recompiles": float(recompiles),
    }


def _compiled_rounds(
    spec: Spec,
    log: EventLog,
    target: TargetModel,
    drafter: Any,
    methods: list[Method],
    encoded: list[torch.Tensor],
    settings: Settings,
    longest: int,
    online: dict[str, OnlineBudget],
) -> CompiledRounds | None:
    """`decode.compile` (true, false, auto: on with CUDA): the prefill and every method's round in fixed shapes,
    compiled and warmed up now, before any clock; None when off, or when this host's torch could not (the run
    says why)."""
    setting = spec.decode.get("compile", "auto")
    if not wanted(setting, target.device):
        return None

    progress = _compile_progress(log)
    started = time.perf_counter()
    enabled, group = bool(spec.decode.get("compile_cache", True)), spec.decode.get("compile_cache_group")

    def compile_now() -> CompiledRounds | str:
        return compile_rounds(target, drafter, methods, encoded[0], longest, settings.max_new_tokens, progress,
                              settings.temperature, online)  # fmt: skip

    with CompileCache.open(spec.run_dir, enabled, group) as cache:
        outcome = compile_now()
    fell_back = isinstance(outcome, str) and cache.enabled and (full := cache.space_problem(outcome)) is not None
    if fell_back:
        # The cache's disk (the work folder's) filled up during the compile: once more, cold, in a private folder
        # of the system's temporary space (often another disk), removed when the worker ends
        scratch = Path(tempfile.mkdtemp(prefix="ddtree-compile-"))
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        LOG.warning("decode.compile: %s; compiling cold in %s instead", full, scratch)
        with CompileCache.open(scratch, False) as cache:
            outcome = compile_now()
    if isinstance(outcome, str):
        if (full := cache.space_problem(outcome)) is not None:
            LOG.warning("decode.compile: torch.compile failed: %s; decoding eagerly (%s)", full, outcome)
        else:
            LOG.warning("decode.compile: torch.compile failed on this host, decoding eagerly (%s)", outcome)
        return None
    cached = "refused" if fell_back else cache.outcome()  # full: not used for this run's rounds
    log.emit("params", {"compile_cache": cached})
    LOG.info(
        "compiled the prefill and %d rounds in %.1f s (compile cache: %s)",
        len(methods), time.perf_counter() - started, cached,
    )  # fmt: skip
    return outcome


def _compile_progress(log: EventLog) -> Callable[[int, int, str], None]:
    """The compile's progress as `compile` events; a stop asked for is honoured between graphs (the compile's
    ticker calls from its own thread, where it cannot be)."""

    def progress(done: int, total: int, message: str) -> None:
        if threading.current_thread() is threading.main_thread():
            stop_signal.check()
        log.progress("compile", done, total, message)

    return progress


def _compile_one_more(
    log: EventLog,
    compiled: CompiledRounds,
    target: TargetModel,
    drafter: Any,
    method: Method,
    prompt: torch.Tensor,
    settings: Settings,
) -> None:
    """Phase 2's round, compiled beside phase 1's (the chosen budget was not known before); if this host's
    torch cannot, that method decodes with the reference round and the run says why."""
    problem = add_round(compiled, target, drafter, method, prompt, settings.max_new_tokens, _compile_progress(log),
                        settings.temperature)  # fmt: skip
    if problem is not None:
        LOG.warning("decode.compile: the %s round could not be compiled, decoding it eagerly (%s)", method.scope,
                    problem)  # fmt: skip


def _job_context(spec: Spec, target: TargetModel, prompts: list[Prompt]) -> dict[str, Any]:
    """What a child run needs to be compared with children of other jobs: the job's model, dtype, seed, prompts."""
    source = spec.experiment.get("prompts")
    return {
        "model": spec.model.name,
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device),
        "seed": spec.seed,
        "prompts": str(source) if source is not None else prompt_source(spec).name,
    }


def _method_params(method: Method, block_size: int, settings: Settings, prompts: int, compiled: bool) -> dict[str, Any]:
    return {
        "method": method.name,
        "tree_budget": method.budget,
        "block_size": block_size if method.drafts else 1,
        "temperature": settings.temperature,
        "max_new_tokens": settings.max_new_tokens,
        "repeats": settings.repeats,
        "num_prompts": prompts,
        "compiled": compiled,
    }
