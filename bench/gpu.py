"""The GPU benchmark (`bench/gpu.sh`): one table, in well under 8 minutes on one GPU.

1. Verify cost at Qwen3.6-27B layer sizes (random weights, bfloat16): one period of its layer pattern
   (three Gated DeltaNet layers and one gated full-attention layer) after a 2048-token prefill, a DDTree
   tree of N nodes against a chain of N tokens, timed alternately with CUDA synchronisation, beside the
   weight-read floor: the bytes of weights a round reads (the four layers and the LM head) over the
   device's measured copy bandwidth. Also the operations one verify dispatches on the device.
1b. Operations per round on the 64-layer tiny-width models (`bench/op_counts.py`, counted on the host).
2. End-to-end decoding on the trained tiny pair (AR, DFlash, DDTree at budget 32) on the GPU, in float32
   and in bfloat16 (lossless, near-tie and unexplained divergences).
3. A whole DDTree round in fixed shapes (`remote_worker/decoding/fixed_round.py`: draft, tree built on the
   device, verify, walk, commit) at those layer sizes with a drafter of Qwen3.6-27B-DFlash's sizes (five
   layers, its target layers mapped onto the period's four), at 16-128 nodes: eager, and compiled with CUDA
   graphs (`mode="reduce-overhead"`, captured in the warm-up), beside the weight-read floor of what the
   round reads (the period's layers, the drafter's, the LM head).

`--device cpu --small` runs the same code with small layers, to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from bench.decode_figures import decode_figures
from bench.op_counts import op_count_figures
from remote_worker.cache.tree import Tree
from remote_worker.decoding.tree_build import best_first_tree
from remote_worker.models.target import TargetModel
from remote_worker.op_count import count_operations

RESULTS = Path(__file__).parent / "results"

# Qwen3.5/3.6-27B text layers (check against the checkpoint's config.json); a small stand-in for --small.
LAYER_SIZES = {
    "qwen3_6_27b": {
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 248320,
    },
    "small": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 512,
    },
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), median of 5."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(6):
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() / statistics.median(times[1:])


def round_weight_bytes(model: torch.nn.Module) -> int:
    """Weights a verify round reads: every layer's and the LM head's (the embedding is read row by row)."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding) + (
        embedding.numel() * embedding.element_size() if model.get_output_embeddings().weight is embedding else 0
    )


def period_model(sizes: dict, device: torch.device) -> torch.nn.Module:
    """One period of Qwen3.6-27B's layer pattern (three GDN layers, one gated attention layer), seeded,
    bfloat16."""
    config = transformers.Qwen3_5TextConfig(
        **sizes,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def verify_costs(sizes: dict, device: torch.device, prefill: int, repeats: int) -> list[dict]:
    model = period_model(sizes, device)
    target = TargetModel(model)
    generator = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    with torch.no_grad():
        target.prefill(cache, torch.randint(0, sizes["vocab_size"], (prefill,), generator=generator), chunk=256)
    floor_ms = 1000 * round_weight_bytes(model) / copy_bandwidth(device)
    rows = []
    for nodes in (16, 32, 64, 128):
        chain = Tree.chain(torch.randint(0, sizes["vocab_size"], (nodes,), generator=generator))
        log_probs = torch.log_softmax(torch.randn(15, sizes["vocab_size"], generator=generator) * 3, dim=-1)
        tree = best_first_tree(int(chain.tokens[0]), log_probs, budget=nodes - 1).tree
        times: dict[str, list[float]] = {"chain": [], "tree": []}
        for index in range(repeats + 3):
            for name, shape in (("chain", chain), ("tree", tree)):
                _sync(device)
                start = time.perf_counter()
                target.verify(cache, shape)
                _sync(device)
                if index >= 3:  # the first rounds warm up kernels and allocators
                    times[name].append(time.perf_counter() - start)
        chain_ms, tree_ms = (1000 * statistics.median(times[k]) for k in ("chain", "tree"))
        operations = count_operations(lambda t=target, c=cache, shape=tree: t.verify(c, shape)).compute
        rows.append(
            {
                "nodes": nodes,
                "tree_depth": int(tree.depths.max()),
                "chain_ms": chain_ms,
                "tree_ms": tree_ms,
                "floor_ms": floor_ms,
                "operations": operations,
            }
        )
    del model, target, cache
    return rows


def draft_sizes(sizes: dict, small: bool) -> dict:
    """Qwen3.6-27B-DFlash's drafter (five layers, four windowed; block 16), or a small stand-in."""
    vocab = sizes["vocab_size"]
    if small:
        return {
            "hidden_size": sizes["hidden_size"],
            "intermediate_size": sizes["intermediate_size"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_hidden_layers": 2,
            "vocab_size": vocab,
            "block_size": 16,
            "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": vocab - 1},
        }
    return {
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 5,
        "vocab_size": vocab,
        "block_size": 16,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "sliding_window": 2048,
        "max_position_embeddings": 262144,
        "rope_theta": 10000000,
        "rms_norm_eps": 1e-6,
        # its target layers 1, 16, 31, 46, 61 of 64, mapped onto the period's four (modulo 4)
        "dflash_config": {"target_layer_ids": [1, 0, 3, 2, 1], "mask_token_id": vocab - 2},
    }


def round_costs(sizes: dict, device: torch.device, prefill: int, repeats: int, small: bool) -> list[dict]:
    """Milliseconds of one whole DDTree round at 16-128 nodes, eager and compiled, after a `prefill`."""
    from remote_worker.decoding.compiled import raise_recompile_limit
    from remote_worker.decoding.fixed_round import FixedRound
    from remote_worker.decoding.loop import fixed_capacity
    from remote_worker.decoding.loop import prefill as prefill_prompt
    from remote_worker.models.dflash import build_draft

    model = period_model(sizes, device)
    target = TargetModel(model)
    drafter = build_draft(draft_sizes(sizes, small), 0, torch.bfloat16, device)
    prompt = torch.randint(0, sizes["vocab_size"], (prefill + 1,), generator=torch.Generator().manual_seed(0))
    start = prefill_prompt(target, prompt, drafter)
    budgets = (15, 31, 63, 127)
    capacity = fixed_capacity(prefill + 1, 16, drafter.block_size, max(budgets))
    target.reserve_positions(capacity)
    draft_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    floor_ms = 1000 * (round_weight_bytes(model) + draft_bytes) / copy_bandwidth(device)
    raise_recompile_limit(len(budgets))
    mode = "reduce-overhead" if device.type == "cuda" else None
    rows = []
    for budget in budgets:
        row: dict = {"nodes": budget + 1, "floor_ms": floor_ms}
        for side in ("eager", "compiled"):
            rounds = FixedRound(target, "ddtree", capacity, drafter=drafter, budget=budget)
            started = time.perf_counter()
            times = []
            try:
                if side == "compiled":
                    rounds.compile(mode)
                for index in range(repeats + 3):  # the first rounds compile, capture and warm up
                    rounds.reset(start.cache, start.draft_context, start.root, None)
                    _sync(device)
                    begun = time.perf_counter()
                    rounds.run()
                    _sync(device)
                    if index == 2:
                        row[f"{side}_warmup_s"] = time.perf_counter() - started
                    if index >= 3:
                        times.append(time.perf_counter() - begun)
            except Exception as error:  # noqa: BLE001 - a bench reports what failed and goes on with the rest
                row[f"{side}_error"] = f"{type(error).__name__}: {str(error).strip()[:300]}"
                continue
            row[f"{side}_ms"] = 1000 * statistics.median(times)
            row[f"{side}_ms_range"] = [1000 * min(times), 1000 * max(times)]
            del rounds
        rows.append(row)
    del model, target, drafter, start
    return rows


def depth_figures(device: str, small: bool) -> list[dict]:
    """Compile time against depth on this device (tiny widths, Qwen3.6-27B's pattern, bfloat16, CUDA graphs):
    the prefill, AR and DDTree-32 at 4 and 64 layers, cold and then warm from the same compile cache, and
    the Qwen3-Next twin's AR round at 48 layers (its experts on grouped matmuls), cold. One process each."""
    import subprocess
    import sys
    import tempfile

    runs = [("qwen3_6_27b", 4), ("qwen3_6_27b", 64), ("qwen3_next", 48)][: 1 if small else 3]
    rows = []
    for model, layers in runs:
        with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
            for side in ("cold", "warm") if model != "qwen3_next" else ("cold",):
                command = [sys.executable, "-m", "bench.compile_depth", "--depth", str(layers), "--cache", cache,
                           "--model", model, "--device", device, "--dtype", "bfloat16", "--budgets", "32"]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    rows.append({"model": model, "depth": layers, "cache": side, "error": done.stderr[-500:]})
                    continue
                rows.append({**json.loads(done.stdout.strip().splitlines()[-1]), "cache": side})
    return [row for row in rows if "error" not in row] + [row for row in rows if "error" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small layers (a check of the script, not a result)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--parts", default="rounds,verify,decode,depth", help="which parts to run (comma-separated)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    name = "small" if args.small else "qwen3_6_27b"
    started = time.monotonic()
    prefill = 256 if args.small else 2048
    rounds = round_costs(LAYER_SIZES[name], device, prefill, args.repeats, args.small) if "rounds" in parts else []
    if device.type == "cuda":
        torch.cuda.empty_cache()
    verify = verify_costs(LAYER_SIZES[name], device, prefill, args.repeats) if "verify" in parts else []
    decoding = []
    if "decode" in parts:
        decoding = [
            decode_figures("tiny_trained", repeats=2, device=args.device, budgets=(32,), prompts=None),
            # bfloat16 on the GPU: where tree verification and one-token decoding may round differently
            decode_figures(
                "tiny_trained", repeats=1, device=args.device, budgets=(32,), prompts=None, dtype="bfloat16"
            ),
        ]
    counts = op_count_figures() if "verify" in parts else []
    depth = depth_figures(args.device, args.small) if "depth" in parts else []
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {
        "device": gpu, "layer_sizes": name, "rounds": rounds, "verify": verify, "op_counts": counts, "decode": decoding,
        "compile_depth": depth,
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{gpu}, torch {torch.__version__}, {time.monotonic() - started:.0f} s")
    print(
        f"| DDTree round at {name} layer sizes + its drafter (bf16) | eager ms (range) | compiled ms (range) "
        "| eager / compiled | weight-read floor ms | compiled / floor | compile + capture s |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rounds:
        if "eager_ms" not in row or "compiled_ms" not in row:
            print(f"| {row['nodes']} nodes | {row.get('eager_error', '')} | {row.get('compiled_error', '')} | | | | |")
            continue
        print(
            f"| {row['nodes']} nodes | {row['eager_ms']:.2f} ({row['eager_ms_range'][0]:.2f}–"
            f"{row['eager_ms_range'][1]:.2f}) | {row['compiled_ms']:.2f} ({row['compiled_ms_range'][0]:.2f}–"
            f"{row['compiled_ms_range'][1]:.2f}) | {row['eager_ms'] / row['compiled_ms']:.2f} "
            f"| {row['floor_ms']:.2f} | {row['compiled_ms'] / row['floor_ms']:.1f} | {row['compiled_warmup_s']:.0f} |"
        )
    print(
        f"| verify at {name} layer sizes (3 GDN + 1 attention, bf16) | tree ms | chain ms | tree / chain "
        "| weight-read floor ms | tree / floor | operations per verify |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in verify:
        print(
            f"| {row['nodes']} nodes (tree depth {row['tree_depth']}) | {row['tree_ms']:.2f} | {row['chain_ms']:.2f} "
            f"| {row['tree_ms'] / row['chain_ms']:.2f} | {row['floor_ms']:.2f} "
            f"| {row['tree_ms'] / row['floor_ms']:.1f} | {row['operations']} |"
        )
    for row in counts:
        print(
            f"| {row['model']}: operations per verify (1 / 64 nodes) | {row['verify_1']} / {row['verify_64']} "
            f"| commit {row['commit']} | host copies per round {row['host_copies_per_round']} "
            f"| model's own step {row['eager_step']} | | |"
        )
    for row in depth:
        same = "yes" if all(row["same_tokens_as_reference"].values()) else "NO"
        seconds = ", ".join(f"{graph} {value:.0f} s" for graph, value in row["compile_s"].items())
        print(
            f"| compile, {row['model']} twin at {row['depth']} layers ({row['dtype']}, {row['cache']}) | {seconds} "
            f"| all {row['compile_s_total']:.0f} s | same tokens {same} | recompiles {row['recompiles']} "
            f"| graph breaks {sum(row['graph_breaks'].values())} | |"
        )
    for pair in decoding:
        for row in pair["methods"]:
            print(
                f"| {pair['model']} {pair['dtype']} {row['method']} | tau {row['tau']:.2f} "
                f"| {row['tokens_per_s']:.0f} tok/s | ×{row['speedup_vs_ar']:.2f} vs AR, "
                f"lossless {row['lossless']:.2f}, {row['near_tie_divergences']:.0f} near-tie, "
                f"{row['unexplained_divergences']:.0f} unexplained |"
            )


if __name__ == "__main__":
    main()
