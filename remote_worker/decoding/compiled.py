"""`decode.compile`: the prefill and every method's round, in fixed shapes, compiled once and warmed up before
the clock starts.

`auto` (the default) compiles on a CUDA device, where a round of thousands of small kernels is bound by
their launches and a CUDA graph (`mode="reduce-overhead"`) replays them at once; on a CPU it stays off unless
asked (`true`), since compiling there takes about half a minute per method and pays back only on long
runs (`make bench` measures it). What compiling costs is measured per method (`compile_s`: its warm-up, the
first rounds, which compile), and every graph compiled after the warm-up is counted (`recompiles`): with
shapes fixed per (method, budget) and buffers allocated once there should be none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import counters

from remote_worker.decoding.fixed_prefill import FixedPrefill
from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import decode_from, fixed_capacity, prefill
from remote_worker.decoding.online_budget import OnlineBudget
from remote_worker.decoding.online_round import OnlineRound
from remote_worker.heartbeat import beating
from remote_worker.models.target import TargetModel, prefill_chunk

LOG = logging.getLogger(__name__)


def wanted(setting: object, device: torch.device) -> bool:
    """Whether `decode.compile` (true, false or "auto") asks for compiled rounds on this device (at any
    temperature: a round samples on the device, `fixed_round.choose_on_device`)."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def raise_recompile_limit(graphs: int) -> None:
    """One graph per (method, budget) comes from one code object; dynamo's default limit is 8 per object."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), graphs + 4))


class CompileProgress:
    """Progress while the graphs compile, never silent: a line when each graph starts and, from a thread,
    every `every` seconds while it compiles (`compiling the ddtree_tb32 round (4/6) · 1:10`), so the
    orchestrator's stall warning (45 s without an event) never fires on a long compile.

    The bar counts seconds: done is the time spent so far, and the total adds to it the graphs still to
    compile at the mean time of those compiled so far (the current one at least as long as it has taken),
    so its ETA comes from what this host has compiled, not from a guess."""

    def __init__(self, send: Callable[[int, int, str], None], graphs: int, every: float = 10.0) -> None:
        self.send, self.graphs, self.every = send, graphs, every
        self.took: list[float] = []  # seconds per compiled graph
        self.started = time.monotonic()

    def _report(self, what: str, since: float) -> None:
        now = time.monotonic()
        current = now - since
        mean = sum(self.took) / len(self.took) if self.took else current
        left = max(mean - current, 0.0) + mean * (self.graphs - len(self.took) - 1)
        elapsed = now - self.started
        minutes, seconds = divmod(int(current), 60)
        message = f"compiling the {what} ({len(self.took) + 1}/{self.graphs}) · {minutes}:{seconds:02d}"
        self.send(int(elapsed), max(int(elapsed + left), int(elapsed), 1), message)

    @contextmanager
    def graph(self, what: str) -> Iterator[None]:
        since = time.monotonic()
        self._report(what, since)
        try:
            with beating(self.every, lambda: self._report(what, since), "compile-progress"):
                yield
        finally:
            self.took.append(time.monotonic() - since)


@dataclass
class CompiledRounds:
    rounds: dict[str, FixedRound]  # method scope -> its compiled round
    prefiller: FixedPrefill | None = None  # the compiled prefill every prompt goes through
    compile_seconds: dict[str, float] = field(default_factory=dict)  # method scope (or "prefill") -> its warm-up
    graphs_after_warmup: int = 0
    capacity: int = 0  # positions every round was built for (`fixed_capacity` at the largest budget)
    mode: str | None = None  # torch.compile's mode the rounds were compiled with

    def recompiles(self) -> int:
        """Graphs compiled since the warm-up ended (each is a recompilation of some method's round)."""
        return counters["stats"]["unique_graphs"] - self.graphs_after_warmup


def compile_rounds(
    target: TargetModel,
    drafter: Any,
    methods: list[Any],
    prompt: torch.Tensor,
    longest: int,
    max_new_tokens: int,
    progress: Callable[[int, int, str], None] | None = None,
    temperature: float = 0.0,
    online: Mapping[str, OnlineBudget] | None = None,
) -> CompiledRounds | str:
    """Build, compile and warm up the prefill (fixed chunks) and a fixed-shape round per method (`Method` of
    `comparison`), for prompts of up to `longest` tokens: `prompt` is prefilled twice, and decoded twice by
    each method (the second call is the one a CUDA graph is captured on). Returns them, or why this host's
    torch could not compile them (the run then decodes with the reference rounds). `progress(done, total,
    message)` is called as each graph starts and every few seconds while it compiles (`CompileProgress`;
    from another thread then). `ddtree_online` (its policy in `online`, by scope) gets an `OnlineRound` with
    a draft and a verify graph per captured size (`OnlineBudget.captured`)."""
    if problem := target.compile_problem():
        return f"model: {problem}"
    mode = "reduce-overhead" if target.device.type == "cuda" else None
    policies = {scope: policy.captured() for scope, policy in (online or {}).items()}
    raise_recompile_limit(len(methods) + 1 + sum(2 * len(policy.sizes) for policy in policies.values()))
    budget = max((m.budget for m in methods), default=0)
    capacity = fixed_capacity(longest, max_new_tokens, drafter.block_size, budget)
    chunk = prefill_chunk(target.device)
    prefill_capacity = -(-(longest + chunk) // 256) * 256
    target.reserve_positions(max(capacity, prefill_capacity))  # before any graph: none may see the tables grow
    compiled = CompiledRounds(rounds={}, capacity=capacity, mode=mode)
    warmup_tokens = min(max_new_tokens, 8)
    clock = CompileProgress(progress or (lambda done, total, message: None), len(methods) + 1)
    where = "prefill"  # what is being compiled, for the reason if it fails
    try:
        prefiller = FixedPrefill(target, prefill_capacity, chunk, drafter.feature_layers)
        prefiller.compile(mode)
        started = time.perf_counter()
        with clock.graph("prefill"):
            for _ in range(2):
                start = prefill(target, prompt, drafter, prefiller)
        compiled.compile_seconds["prefill"] = time.perf_counter() - started
        compiled.prefiller = prefiller
        for method in methods:
            where = method.scope
            policy = policies.get(method.scope)
            _compile_round(compiled, target, drafter, method, start, warmup_tokens, temperature, clock, policy)
    except Exception as error:  # noqa: BLE001 - any failure of the compiler means: decode with the reference
        return _why(where, error)
    compiled.graphs_after_warmup = counters["stats"]["unique_graphs"]
    total = int(time.monotonic() - clock.started)
    clock.send(total, max(total, 1), f"compiled in {sum(compiled.compile_seconds.values()):.0f} s")
    return compiled


def _why(where: str, error: Exception) -> str:
    """A compiler's failure in one line: what was compiling, the error's type and its first line."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{where}: {type(error).__name__}: {text}"[:300]


def _compile_round(
    compiled: CompiledRounds,
    target: TargetModel,
    drafter: Any,
    method: Any,
    start: Any,
    warmup_tokens: int,
    temperature: float,
    clock: CompileProgress,
    policy: OnlineBudget | None = None,
) -> None:
    """One method's fixed-shape round, compiled and warmed up from `start` (two decodes: the second is the one
    a CUDA graph is captured on; then every other graph it may run: `FixedRound.warm_every_size`), kept in
    `compiled`. `policy`: the method's per-round budget (`ddtree_online`, an `OnlineRound`)."""
    round_drafter = drafter if method.drafts else None
    rounds: FixedRound
    if policy is not None:
        rounds = OnlineRound(target, compiled.capacity, drafter=drafter, policy=policy, temperature=temperature)
        what = f"{method.scope} round ({len(policy.sizes)} sizes)"
    else:
        rounds = FixedRound(target, method.name, compiled.capacity, drafter=round_drafter, budget=method.budget,
                            temperature=temperature)  # fmt: skip
        what = f"{method.scope} round"
    rounds.compile(compiled.mode)

    def generator(seed: int) -> torch.Generator | None:
        return torch.Generator(target.device).manual_seed(seed) if temperature else None

    def reset(attempt: int) -> None:
        rounds.reset(start.cache, start.draft_context, start.root, generator(attempt))

    started = time.perf_counter()
    with clock.graph(what):
        for seed in range(2):
            decode_from(target, start, method=method.decoder, max_new_tokens=warmup_tokens, drafter=round_drafter,
                        budget=method.budget, rounds=rounds, temperature=temperature,
                        generator=generator(seed))  # fmt: skip
        rounds.warm_every_size(reset)
    compiled.compile_seconds[method.scope] = time.perf_counter() - started
    compiled.rounds[method.scope] = rounds
    LOG.info("compiled the %s round in %.1f s", method.scope, compiled.compile_seconds[method.scope])


def add_round(
    compiled: CompiledRounds,
    target: TargetModel,
    drafter: Any,
    method: Any,
    prompt: torch.Tensor,
    max_new_tokens: int,
    progress: Callable[[int, int, str], None] | None = None,
    temperature: float = 0.0,
) -> str | None:
    """One more method's round beside those `compile_rounds` built (a budget no larger than theirs: the rounds'
    capacity holds it), warmed up from `prompt`; None, or why this host's torch could not (the method then
    decodes with the reference round). The graphs it adds are not counted as recompilations."""
    raise_recompile_limit(len(compiled.rounds) + 2)
    clock = CompileProgress(progress or (lambda done, total, message: None), 1)
    try:
        start = prefill(target, prompt, drafter, compiled.prefiller)
        _compile_round(compiled, target, drafter, method, start, min(max_new_tokens, 8), temperature, clock)
    except Exception as error:  # noqa: BLE001 - as in compile_rounds: the reference round decodes instead
        return _why(method.scope, error)
    finally:
        compiled.graphs_after_warmup = counters["stats"]["unique_graphs"]
    return None
