"""`decode.compile`: every method's fixed-shape round compiled once and warmed up before the clock starts.

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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import counters

from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import decode_from, prefill
from remote_worker.models.target import TargetModel

LOG = logging.getLogger(__name__)


def wanted(setting: object, device: torch.device, temperature: float) -> bool:
    """Whether `decode.compile` (true, false or "auto") asks for compiled rounds on this device."""
    if setting == "auto":
        return device.type == "cuda" and temperature == 0
    return bool(setting)


def _raise_recompile_limit(graphs: int) -> None:
    """One graph per (method, budget) comes from one code object; dynamo's default limit is 8 per object."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), graphs + 4))


@dataclass
class CompiledRounds:
    rounds: dict[str, FixedRound]  # method scope -> its compiled round
    compile_seconds: dict[str, float] = field(default_factory=dict)  # method scope -> its warm-up
    graphs_after_warmup: int = 0

    def recompiles(self) -> int:
        """Graphs compiled since the warm-up ended (each is a recompilation of some method's round)."""
        return counters["stats"]["unique_graphs"] - self.graphs_after_warmup


def compile_rounds(
    target: TargetModel,
    drafter: Any,
    methods: list[Any],
    prompt: torch.Tensor,
    capacity: int,
    max_new_tokens: int,
) -> CompiledRounds | str:
    """Build, compile and warm up a fixed-shape round per method (`Method` of `comparison`), decoding `prompt`
    twice with each (the second call is the one a CUDA graph is captured on). Returns the rounds, or why
    this host's torch could not compile them (the run then decodes with the reference rounds)."""
    mode = "reduce-overhead" if target.device.type == "cuda" else None
    _raise_recompile_limit(len(methods))
    compiled = CompiledRounds(rounds={})
    start = prefill(target, prompt, drafter)
    warmup_tokens = min(max_new_tokens, 8)
    for method in methods:
        round_drafter = drafter if method.drafts else None
        rounds = FixedRound(target, method.name, capacity, drafter=round_drafter, budget=method.budget)
        rounds.compile(mode)
        started = time.perf_counter()
        try:
            for _ in range(2):
                decode_from(target, start, method=method.name, max_new_tokens=warmup_tokens, drafter=round_drafter,
                            budget=method.budget, rounds=rounds)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - any failure of the compiler means: decode with the reference
            text = str(error).strip().splitlines()[0] if str(error).strip() else ""
            return f"{method.scope}: {type(error).__name__}: {text}"[:300]
        compiled.compile_seconds[method.scope] = time.perf_counter() - started
        compiled.rounds[method.scope] = rounds
        LOG.info("compiled the %s round in %.1f s", method.scope, compiled.compile_seconds[method.scope])
    compiled.graphs_after_warmup = counters["stats"]["unique_graphs"]
    return compiled
