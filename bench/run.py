"""`make bench`: decoding on the trained tiny pairs, the worker's costs and the orchestrator's figures.

Ratios are measured side by side in one run. Writes bench/results/bench.json and bench/results/bench.md
(the table the README shows).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from bench.decode_figures import decode_figures
from bench.orchestrator_figures import orchestrator_figures
from bench.worker_figures import worker_figures

RESULTS = Path(__file__).parent / "results"


def _decode_table(results: list[dict]) -> list[str]:
    lines = [
        "| model | method | tau | tau without repetition | tokens/s | speedup vs AR | lossless | repetition share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pair in results:
        for row in pair["methods"]:
            lines.append(
                f"| {pair['model']} | {row['method']} | {row['tau']:.2f} | {row['tau_without_repetition']:.2f} "
                f"| {row['tokens_per_s']:.0f} "
                f"| {row['speedup_vs_ar']:.2f} | {row['lossless']:.0f} | {row['repetition_share']:.2f} |"
            )
    first = results[0]
    note = (
        f"Temperature 0, {first['prompts']} held-out prompts (functions from standard-library files the "
        f"training never saw), {first['max_new_tokens']} new tokens each; tokens/s and speedup are medians "
        f"of {first['repeats']} passes, each method decoding every prompt in turn with AR."
    )
    return [note, "", *lines]


def _worker_rows(results: dict) -> list[str]:
    rows = []
    for row in results["verify_cost"]:
        rows.append(
            f"| verify a {row['nodes']}-node tree / a {row['nodes']}-token chain (tree depth {row['tree_depth']}) "
            f"| {row['tree_over_chain']:.2f} ({row['tree_ms']:.2f} ms / {row['chain_ms']:.2f} ms) | ≤ 1.3 |"
        )
    share = results["commit_share"]
    rows.append(
        f"| commit share of a DDTree round (budget {share['tree_budget']}) "
        f"| {100 * share['commit_share']:.1f} % ({share['commit_ms_per_round']:.2f} ms per round) | ≤ 5 % |"
    )
    return rows


def _orchestrator_rows(results: dict) -> list[str]:
    if "skipped" in results:
        return [f"| orchestrator figures | skipped: {results['skipped']} | |"]
    sync, latency, sink = results["sync"], results["event_latency"], results["sink_throughput"]
    size = f"{sync['files']} files, {sync['bytes'] / 1024:.0f} KiB"
    return [
        f"| sync, unchanged tree ({size}) | {sync['unchanged_ms']:.0f} ms | < 1500 ms |",
        f"| sync, one file changed: rsync --link-dest / tar | {sync['one_file_rsync_ms']:.0f} ms / "
        f"{sync['one_file_tar_ms']:.0f} ms | |",
        f"| sync, full copy: rsync / tar | {sync['full_rsync_ms']:.0f} ms / {sync['full_tar_ms']:.0f} ms | |",
        *_large_sync_rows(results["sync_large"]),
        f"| event → MLflow latency over SSH, p50 / p95 (poll every {latency['poll_interval_s']} s, "
        f"{latency['events']} events) | {latency['p50_ms']:.0f} ms / {latency['p95_ms']:.0f} ms | p50 < 1000 ms |",
        f"| MLflow metrics/s: sink / one call per metric ({sink['metrics']} metrics) "
        f"| {sink['sink_per_s']:.0f} / {sink['per_call_per_s']:.0f} = {sink['ratio']:.0f}× | ≥ 20× |",
    ]


def _large_sync_rows(sync: dict) -> list[str]:
    size = f"{sync['files']} files, {sync['bytes'] / (1 << 20):.0f} MiB"
    return [
        f"| sync of a larger tree ({size}), one file changed: rsync --link-dest / tar "
        f"| {sync['one_file_rsync_ms']:.0f} ms / {sync['one_file_tar_ms']:.0f} ms | |",
        f"| sync of a larger tree, full copy: rsync / tar | {sync['full_rsync_ms']:.0f} ms / "
        f"{sync['full_tar_ms']:.0f} ms | |",
    ]


def markdown(results: dict) -> str:
    lines = [
        f"Measured by `make bench` on {results['machine']} ({results['date']}), float32, CPU.",
        "",
        "Decoding on the trained tiny pairs:",
        "",
        *_decode_table(results["decode"]),
        "",
        "The worker's costs on tiny_hybrid, and the orchestrator against an sshd and an `mlflow server` on 127.0.0.1:",
        "",
        "| figure | value | aim |",
        "|---|---|---|",
        *_worker_rows(results["worker"]),
        *_orchestrator_rows(results["orchestrator"]),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--decode-repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    results = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "decode": [decode_figures(name, args.decode_repeats) for name in ("tiny_trained", "tiny_trained_dense")],
        "worker": worker_figures(args.repeats),
        "orchestrator": orchestrator_figures(args.repeats),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "bench.md").write_text(markdown(results))
    print(json.dumps(results, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
