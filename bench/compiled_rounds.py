"""Compiled fixed-shape rounds against eager ones on a trained tiny pair, side by side in one run.

For each method (AR, DFlash, DDTree at each budget) three rounds decode the same prompts in turn: the
reference round (`loop.decode_from`, host heap and walk), the fixed-shape round run eagerly, and the same
round through `torch.compile` (`decode.compile`). Reported per method: tokens/s of each (median over the
prompts' passes, with the range), compiled over eager, whether each emitted AR's tokens, the compile time
(its warm-up, the prefill's apart; a cold compile: inductor's caches start empty), graphs compiled after
the warm-up (recompiles), graph breaks (`torch._dynamo.explain` of one round), and what one round moves
between host and device (counted on `meta`: compiled or not, the round itself reads nothing back and
copies nothing over; the loop reads the packed tokens once).

    python -m bench.compiled_rounds --threads 1 --prompts 6 --new-tokens 64 --budgets 16,32,64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any


def measure(pair: str, budgets: list[int], new_tokens: int, prompts: int, threads: int) -> dict[str, Any]:
    import torch

    from bench.decode_speed import load_pair
    from remote_worker.decoding.comparison import methods_for
    from remote_worker.decoding.compiled import compile_rounds
    from remote_worker.decoding.fixed_round import FixedRound
    from remote_worker.decoding.loop import decode_from, fixed_capacity, prefill
    from remote_worker.op_count import count_operations
    from tests.test_fixed_round import meta_pair

    target, drafter, ids = load_pair(pair, prompts, threads)
    methods = methods_for(budgets)
    longest = max(len(i) for i in ids)
    capacity = fixed_capacity(longest, new_tokens, drafter.block_size, max(budgets))
    started = time.perf_counter()
    compiled = compile_rounds(target, drafter, methods, ids[0], longest, new_tokens)
    if isinstance(compiled, str):
        raise SystemExit(f"torch.compile failed: {compiled}")
    compile_total = time.perf_counter() - started
    eager = {
        m.scope: FixedRound(target, m.name, capacity, drafter=drafter if m.drafts else None, budget=m.budget)
        for m in methods
    }
    sides = {"reference": None, "fixed_eager": eager, "compiled": compiled.rounds}
    rates: dict[str, dict[str, list[float]]] = {m.scope: {side: [] for side in sides} for m in methods}
    same: dict[str, dict[str, int]] = {m.scope: dict.fromkeys(sides, 0) for m in methods}
    rounds_seen: dict[str, int] = {m.scope: 0 for m in methods}
    for prompt in ids:
        start = prefill(target, prompt, drafter)
        reference = None
        for method in methods:
            for side, pool in sides.items():
                result = decode_from(
                    target, start, method=method.name, max_new_tokens=new_tokens,
                    drafter=drafter if method.drafts else None, budget=method.budget,
                    rounds=None if pool is None else pool[method.scope],
                )  # fmt: skip
                reference = reference or result.tokens
                rates[method.scope][side].append(len(result.tokens) / result.decode_seconds)
                same[method.scope][side] += result.tokens == reference
                rounds_seen[method.scope] += result.rounds if side == "compiled" else 0
    recompiles = compiled.recompiles()  # before `explain` below compiles graphs of its own
    meta_target, meta_draft = meta_pair()
    rows = []
    for method in methods:
        r = rates[method.scope]
        round_ = FixedRound(meta_target, method.name, 256, drafter=meta_draft if method.drafts else None,
                            budget=method.budget)  # fmt: skip
        round_.step()
        moved = count_operations(round_.step)
        fresh = FixedRound(
            target, method.name, capacity, drafter=drafter if method.drafts else None, budget=method.budget
        )
        explained = torch._dynamo.explain(fresh.step)()
        rows.append(
            {
                "method": method.scope,
                **{f"tokens_per_s_{side}": statistics.median(v) for side, v in r.items()},
                **{f"tokens_per_s_{side}_range": [min(v), max(v)] for side, v in r.items()},
                "compiled_over_eager": statistics.median(
                    c / e for c, e in zip(r["compiled"], r["fixed_eager"], strict=True)
                ),
                "compiled_over_reference": statistics.median(
                    c / e for c, e in zip(r["compiled"], r["reference"], strict=True)
                ),
                "lossless": {side: same[method.scope][side] / len(ids) for side in sides},
                "compile_s": compiled.compile_seconds[method.scope],
                "graph_breaks": explained.graph_break_count,
                "round_device_reads": moved.scalar_reads,
                "round_host_copies": moved.host_copies,
                "loop_device_to_host_per_round": 1,
            }
        )
    return {
        "pair": pair,
        "threads": threads,
        "prompts": len(ids),
        "new_tokens": new_tokens,
        "budgets": budgets,
        "capacity": capacity,
        "compile_s_total": compile_total,
        "prefill_compile_s": compiled.compile_seconds["prefill"],
        "recompiles": recompiles,
        "rows": rows,
    }


def main() -> None:
    # A cold compile, as on a fresh host: inductor's caches (kernels, FX graphs) start empty in a new folder.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tiny_trained")
    parser.add_argument("--budgets", default="16,32,64", help="DDTree budgets, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    print(json.dumps(measure(args.pair, budgets, args.new_tokens, args.prompts, args.threads)))


if __name__ == "__main__":
    main()
