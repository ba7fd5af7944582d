"""`make bench`: decoding on the trained tiny pairs, the worker's costs and the orchestrator's figures.

Ratios are measured side by side in one run. Writes bench/results/bench.json and bench/results/bench.md
(the table docs/results.md shows).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

from bench.budget_figures import budget_figures, budget_table, check_summary
from bench.compile_depth import compile_depth_figures, compile_depth_table
from bench.decode_figures import decode_figures, prompt_length_check
from bench.decode_speed import compare_workers
from bench.online_budget import online_budget_figures, online_budget_table
from bench.op_counts import op_count_figures
from bench.orchestrator_figures import orchestrator_figures
from bench.paper_protocol import paper_protocol_figures, paper_protocol_table
from bench.worker_figures import worker_figures

RESULTS = Path(__file__).parent / "results"
PAIRS = ("tiny_trained", "tiny_trained_dense")
# The worker before the speed path (issue 13): `make bench` compares this one with it, side by side.
BASELINE = "3df1729"


def _decode_table(results: list[dict]) -> list[str]:
    lines = [
        "| model | method | tau | tau without repetition | decode tokens/s (range) | speedup vs AR (range) "
        "| prefill ms | lossless | repetition share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in results:
        for row in pair["methods"]:
            lines.append(
                f"| {pair['model']} | {row['method']} | {row['tau']:.2f} | {row['tau_without_repetition']:.2f} "
                f"| {row['tokens_per_s']:.0f} ({row['tokens_per_s_min']:.0f}–{row['tokens_per_s_max']:.0f}) "
                f"| {row['speedup_vs_ar']:.2f} ({row['speedup_vs_ar_min']:.2f}–{row['speedup_vs_ar_max']:.2f}) "
                f"| {row['prefill_ms']:.0f} | {row['lossless']:.2f} | {row['repetition_share']:.2f} |"
            )
    first = results[0]
    note = (
        f"Temperature 0, prompts: {first['prompts']} (about {first['prompt_tokens']:.0f} prompt tokens), "
        f"{first['max_new_tokens']} new tokens each. Each prompt is prefilled once; decode tokens/s and speedup "
        f"exclude the prefill and are medians of {first['repeats']} passes (range in brackets), the methods "
        "taking turns, each speedup taken within one pass."
    )
    return [note, "", *lines]


def _divergence_table(results: list[dict]) -> list[str]:
    lines = [
        "| model | dtype | method | lossless | near-tie divergences | unexplained divergences |",
        "|---|---|---|---|---|---|",
    ]
    for pair in results:
        for row in pair["methods"][1:]:
            lines.append(
                f"| {pair['model']} | {pair['dtype']} | {row['method']} | {row['lossless']:.2f} "
                f"| {row['near_tie_divergences']:.0f} | {row['unexplained_divergences']:.0f} |"
            )
    return lines


def _length_table(check: dict) -> list[str]:
    lines = [
        "| prompts | prompt tokens | prefill ms | method | tau | verify ms per round (AR's) "
        "| decode-only speedup | speedup with prefill counted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in check["rows"]:
        lines.append(
            f"| {row['prompts']} | {row['prompt_tokens']:.0f} | {row['prefill_ms']:.0f} | {row['method']} "
            f"| {row['tau']:.2f} | {row['verify_ms_per_round']:.1f} ({row['ar_verify_ms_per_round']:.1f}) "
            f"| {row['speedup_vs_ar']:.2f} | {row['speedup_with_prefill']:.2f} |"
        )
    return lines


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


def _op_count_table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | compute operations per verify, 1 node / 64 nodes | per commit (6-node path) "
        "| host→device copies per round (verify + commit) | the model's own eager decode step |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['verify_1']:,} / {row['verify_64']:,} | {row['commit']} "
            f"| {row['host_copies_per_round']} ({row['host_copies_verify']} + {row['host_copies_commit']}) "
            f"| {row['eager_step']:,} |"
        )
    return lines


def _speed_table(speed: dict) -> list[str]:
    lines = [
        "| method | tau | tokens/s before → after (range) | after / before (range) | ms per round before → after |",
        "|---|---|---|---|---|",
    ]
    for row in speed["rows"]:
        lines.append(
            f"| {row['method']} | {row['tau_after']:.2f} "
            f"| {row['tokens_per_s_before']:.0f} → {row['tokens_per_s_after']:.0f} "
            f"({row['tokens_per_s_after_range'][0]:.0f}–{row['tokens_per_s_after_range'][1]:.0f}) "
            f"| {row['speedup_after']:.2f} ({row['speedup_after_range'][0]:.2f}–{row['speedup_after_range'][1]:.2f}) "
            f"| {row['ms_per_round_before']:.2f} → {row['ms_per_round_after']:.2f} |"
        )
    return lines


def _compiled_table(runs: list[dict]) -> list[str]:
    lines = [
        "| threads | method | tokens/s reference · fixed eager · compiled (range) | compiled / fixed eager "
        "| compiled / reference | compile s | graph breaks | recompiles | round: device reads, host copies "
        "| lossless (ref · eager · compiled) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for row in run["rows"]:
            low, high = row["tokens_per_s_compiled_range"]
            lossless = " · ".join(f"{row['lossless'][side]:.2f}" for side in ("reference", "fixed_eager", "compiled"))
            lines.append(
                f"| {run['threads']} | {row['method']} | {row['tokens_per_s_reference']:.0f} · "
                f"{row['tokens_per_s_fixed_eager']:.0f} · {row['tokens_per_s_compiled']:.0f} ({low:.0f}–{high:.0f}) "
                f"| {row['compiled_over_eager']:.2f} | {row['compiled_over_reference']:.2f} | {row['compile_s']:.0f} "
                f"| {row['graph_breaks']} | {run['recompiles']} | {row['round_device_reads']}, "
                f"{row['round_host_copies']} | {lossless} |"
            )
    lines.append("")
    for run in runs:
        lines.append(
            f"Compiling the prefill and {len(run['rows'])} rounds took {run['compile_s_total']:.0f} s at "
            f"{run['threads']} thread(s) (the prefill {run['prefill_compile_s']:.0f} s); "
            f"{run['recompiles']} graphs were compiled again after the warm-up."
        )
    return lines


def _compiled_runs(threads: tuple[int, ...] = (1, 2)) -> list[dict]:
    """`bench.compiled_rounds`, one process per thread count (a fresh compiler each)."""
    runs = []
    for count in threads:
        out = subprocess.run(
            [sys.executable, "-m", "bench.compiled_rounds", "--threads", str(count)],
            check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


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
        f"Measured by `make bench` on {results['machine']} ({results['date']}), CPU, "
        "float32 unless a row says otherwise.",
        "",
        "Decoding on the trained tiny pairs:",
        "",
        *_decode_table(results["decode"]),
        "",
        f"Exactness against AR on the same prompts, float32 and bfloat16 ({results['bf16'][0]['prompts']}; a "
        "near tie is a first difference where AR's top-2 logits are within the dtype's tolerance):",
        "",
        *_divergence_table(results["decode"] + results["bf16"]),
        "",
        f"Does the speedup still fall as prompts grow? {results['prompt_length']['model']}, "
        f"{results['prompt_length']['max_new_tokens']} new tokens, the same problems as they are and behind a "
        "preamble of four others (the last column counts the prefill as the worker used to, first pass):",
        "",
        *_length_table(results["prompt_length"]),
        "",
        "Which budget? tau at every budget from one decode, and tokens/s predicted from the node costs "
        "(`bench.budget_figures`):",
        "",
        *budget_table(results["budget"]),
        "",
        "The same with a second process busy half the time on one core (the check must flag, not mislead):",
        "",
        *budget_table(results["budget_loaded"]),
        "",
        *check_summary(results["budget"], results["budget_loaded"]),
        "",
        "The paper's table by two phases against the paper's budget grid (`bench.paper_protocol`):",
        "",
        *paper_protocol_table(results["paper_protocol"]),
        "",
        "DDTree with a per-round budget against the best fixed budget, per paper set (`bench.online_budget`):",
        "",
        *online_budget_table(results["online_budget"]),
        "",
        "The same on compiled rounds (`decode.compile=true`: `ddtree_online` on its draft and verify graphs):",
        "",
        *online_budget_table(results["online_budget_compiled"]),
        "",
        "Operations per decode round (counted, so exact: a gate where timings are noise), after a 256-token "
        "prefill on 64-layer models of the real layer pattern at tiny widths (the hybrid is Qwen3.6-27B's: 48 "
        "Gated DeltaNet and 16 attention layers); compute operations as dispatched on the CPU, views and "
        "scalar reads excluded; host→device copies counted on the `meta` device:",
        "",
        *_op_count_table(results["op_counts"]),
        "",
        f"Decode speed of this worker against the one before the speed path ({results['speed']['baseline']}), "
        f"{results['speed']['pair']}, DDTree budget {results['speed']['tree_budget']}, "
        f"{results['speed']['prompts']}, {results['speed']['new_tokens']} new tokens, one thread, decode only; "
        f"medians of {results['speed']['repeats']} passes, one process each, the sides taking turns:",
        "",
        *_speed_table(results["speed"]),
        "",
        "decode.compile: compiled fixed-shape rounds against the same rounds eager and the reference rounds, "
        "tiny_trained, 6 prompts × 64 tokens, side by side in one process per thread count, compiled cold "
        "(`bench.compiled_rounds`):",
        "",
        *_compiled_table(results["compiled"]),
        "",
        "Compile seconds against depth: the default experiment's graphs on tiny-width twins of Qwen3.6-27B's "
        "layer pattern at 4, 16 and 64 layers and of Qwen3-Next at its 48, one thread, cold (an empty compile "
        "cache) and warm (a second process on the same cache), the AR round compiled flat (every layer inline, "
        "as before per-kind regions) beside (`bench.compile_depth`):",
        "",
        *compile_depth_table(results["compile_depth"]),
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
    parser.add_argument("--baseline", default=BASELINE, help="the commit whose worker the speed table compares with")
    parser.add_argument(
        "--only",
        choices=["paper_protocol", "online_budget", "online_budget_compiled"],
        help="run this section alone (its own JSON file)",
    )
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.only is not None:
        run, table = {
            "paper_protocol": (paper_protocol_figures, paper_protocol_table),
            "online_budget": (online_budget_figures, online_budget_table),
            "online_budget_compiled": (partial(online_budget_figures, compiled=True), online_budget_table),
        }[args.only]
        figures = run()
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.only}.json").write_text(json.dumps(figures, indent=1) + "\n")
        print(json.dumps(figures, indent=1))
        print("\n".join(table(figures)))
        return
    results = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "decode": [decode_figures(name, args.decode_repeats) for name in PAIRS],
        "bf16": [decode_figures(name, 1, dtype="bfloat16", budgets=(16, 64)) for name in PAIRS],
        "prompt_length": prompt_length_check("tiny_trained", args.decode_repeats),
        "budget": budget_figures("tiny_trained", args.decode_repeats),
        "budget_loaded": budget_figures("tiny_trained", args.decode_repeats, load=True),
        "paper_protocol": paper_protocol_figures(),
        "online_budget": online_budget_figures(),
        "online_budget_compiled": online_budget_figures(compiled=True),
        "op_counts": op_count_figures(),
        "speed": compare_workers(args.baseline, args.decode_repeats),
        "compiled": _compiled_runs(),
        "compile_depth": compile_depth_figures(),
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
