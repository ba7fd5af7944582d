"""Decode speed of one worker on a trained tiny pair: the figure `make bench` compares across commits.

Run as a program it loads the pair, prefills each prompt once and decodes it with AR, DFlash and DDTree
(decode only; the prefill is kept out), on the number of torch threads asked for, and prints one JSON line:
per method, tokens/s (tokens over decode seconds), ms per verify round and tau. It uses only the worker's
long-standing API (load, prefill, decode_from), so `make bench` can run it against the worker of an older
commit (its `remote_worker/` first on PYTHONPATH) and this one, alternately, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def load_pair(pair: str, prompts: int, threads: int) -> tuple[Any, Any, list[Any]]:
    """The pair in float32 on `threads` torch threads, no autograd, and the first `prompts` humaneval prompts
    encoded: (target, drafter, token ids). Only the worker's long-standing API (see the module's doc)."""
    import torch

    from orchestrator.config.prompts import resolve_prompts
    from remote_worker.models.loading import load_drafter, load_model, load_tokenizer
    from remote_worker.models.target import TargetModel
    from remote_worker.prompts import encode
    from tests.tiny_models import model_spec

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    spec = model_spec(pair, "float32")
    model = load_model(spec, seed=0)
    target, drafter, tokenizer = TargetModel(model), load_drafter(spec, seed=0, target=model), load_tokenizer(spec)
    ids = [encode(p, tokenizer, target.embed.num_embeddings) for p in resolve_prompts("humaneval_completion")[:prompts]]
    return target, drafter, ids


def measure(pair: str, budget: int, new_tokens: int, prompts: int, threads: int) -> dict[str, Any]:
    from remote_worker.decoding.loop import decode_from, prefill

    target, drafter, ids = load_pair(pair, prompts, threads)
    methods = {"ar": 0, "dflash": 0, f"ddtree_tb{budget}": budget}
    started = time.perf_counter()
    warm = prefill(target, ids[0][:32], drafter)
    for name in methods:
        decode_from(target, warm, method=name.split("_")[0], max_new_tokens=8, drafter=drafter, budget=budget)
    warm_up_seconds = time.perf_counter() - started
    totals = {
        name: {"tokens": 0, "seconds": 0.0, "rounds": 0, "verify_seconds": 0.0, "same_as_ar": 0} for name in methods
    }
    for prompt in ids:
        start = prefill(target, prompt, drafter)
        reference = None
        for name, tree_budget in methods.items():
            result = decode_from(
                target, start, method=name.split("_")[0], max_new_tokens=new_tokens, drafter=drafter, budget=tree_budget
            )
            reference = reference or result.tokens
            total = totals[name]
            total["same_as_ar"] += result.tokens == reference
            total["tokens"] += len(result.tokens)
            total["seconds"] += result.decode_seconds
            total["rounds"] += result.rounds
            total["verify_seconds"] += result.stage_seconds["verify"]
    return {
        name: {
            "tokens_per_s": t["tokens"] / t["seconds"],
            "ms_per_round": 1000 * t["seconds"] / t["rounds"],
            "verify_ms_per_round": 1000 * t["verify_seconds"] / t["rounds"],
            "tau": t["tokens"] / t["rounds"],
            "lossless": t["same_as_ar"] / len(ids),
            "warm_up_s": warm_up_seconds,
        }
        for name, t in totals.items()
    }


def _worker_of(revision: str, folder: Path) -> Path:
    """`remote_worker/` of a commit, extracted into `folder` (which then goes first on PYTHONPATH)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "remote_worker"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def _one_pass(root: Path, args: list[str]) -> dict[str, Any]:
    env_path = f"{root}:{REPO}" if root != REPO else str(REPO)
    home = os.environ.get("HOME", "/tmp")
    out = subprocess.run(
        [sys.executable, "-m", "bench.decode_speed", *args],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": env_path, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


SIDES = ("before", "after")


def compare_workers(
    baseline: str,
    repeats: int,
    pair: str = "tiny_trained",
    budget: int = 32,
    new_tokens: int = 64,
    prompts: int = 4,
) -> dict[str, Any]:
    """This worker against the one at `baseline` (decode.compile: `bench.compiled_rounds`), one thread each,
    one process per pass, the sides taking turns (the order rotates every pass), `repeats`
    passes: medians and ranges of tokens/s and ms per round, and of each per-pass ratio to `before`."""
    args = ["--pair", pair, "--budget", str(budget), "--new-tokens", str(new_tokens), "--prompts", str(prompts)]
    sides = SIDES
    with tempfile.TemporaryDirectory() as folder:
        roots = {"before": _worker_of(baseline, Path(folder)), "after": REPO}
        passes: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for index in range(repeats):
            for side in sides[index % len(sides) :] + sides[: index % len(sides)]:
                passes[side].append(_one_pass(roots[side], args))
    rows = []
    for method in passes["after"][0]:
        row: dict[str, Any] = {"method": method}
        for key in ("tokens_per_s", "ms_per_round", "verify_ms_per_round", "tau", "lossless", "warm_up_s"):
            for side in sides:
                values = [p[method][key] for p in passes[side]]
                row[f"{key}_{side}"] = median(values)
                row[f"{key}_{side}_range"] = [min(values), max(values)]
        for side in sides[1:]:
            ratios = [
                a[method]["tokens_per_s"] / b[method]["tokens_per_s"]
                for a, b in zip(passes[side], passes["before"], strict=True)
            ]
            row[f"speedup_{side}"], row[f"speedup_{side}_range"] = median(ratios), [min(ratios), max(ratios)]
        rows.append(row)
    return {
        "baseline": baseline,
        "pair": pair,
        "tree_budget": budget,
        "new_tokens": new_tokens,
        "prompts": f"humaneval_completion (first {prompts})",
        "threads": 1,
        "repeats": repeats,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tiny_trained")
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(measure(args.pair, args.budget, args.new_tokens, args.prompts, args.threads)))


if __name__ == "__main__":
    main()
