"""What compiling costs against the model's depth: the default experiment's graphs (the prefill and the AR,
DFlash and DDTree-16/32/64 rounds) on tiny-width twins with Qwen3.6-27B's layer pattern (3 Gated DeltaNet
+ 1 gated attention, repeated) at 4, 16 and 64 layers, and on the Qwen3-Next twin (mixture of experts) at
its 48.

Each measurement is its own process (a fresh compiler): cold, with an empty compile cache, then warm, a
second process on the same cache folder (`decode.compile_cache`, as a second run on the same host). Per
graph: compile seconds (its warm-up: two calls, as `compile_rounds` does); per process: whether every method's
compiled decode emits the reference round's tokens, graphs compiled after the warm-up (recompiles) and
graph breaks (`torch._dynamo.explain` of each round). `--flat` compiles each layer inline (no per-kind
regions), the whole-model compile as it was, for the AR round only: the comparison.

    python -m bench.compile_depth --depth 64 --cache /tmp/cache [--flat] [--model qwen3_next]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def twin_at(depth: int, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """The Qwen3.6-27B twin and its draft's twin cut to `depth` layers (whole periods of the pattern), the
    draft's target layers mapped into them as the twins' own code maps them."""
    import torch

    from remote_worker.models.dflash import build_draft
    from remote_worker.models.loading import load_model
    from remote_worker.models.target import TargetModel
    from remote_worker.models.twins import map_layers, twin_cases
    from remote_worker.spec import ModelSpec

    case = next(c for c in twin_cases(full_depth=True) if c.id == "Qwen3.6-27B-DFlash")
    config = dict(case.target.config, num_hidden_layers=depth, layer_types=case.target.config["layer_types"][:depth])
    spec = ModelSpec("twin", "config", case.target.arch, dtype, device, config, None)
    target = TargetModel(load_model(spec, seed=0))
    draft_config = json.loads(json.dumps(case.draft.config))
    ids = draft_config["dflash_config"]["target_layer_ids"]
    draft_config["dflash_config"]["target_layer_ids"] = map_layers(ids, 64, depth)
    draft_config["num_target_layers"] = depth
    return target, build_draft(draft_config, 1, getattr(torch, dtype), torch.device(device))


def next_twin(dtype: str = "float32", device: str = "cpu") -> Any:
    """The Qwen3-Next twin at its published 48 layers (sparse experts: 10 routed of 20, a shared expert)."""
    from remote_worker.models.loading import load_model
    from remote_worker.models.target import TargetModel
    from remote_worker.models.twins import twin_cases
    from remote_worker.spec import ModelSpec

    twin = next(c for c in twin_cases(full_depth=True) if c.id == "Qwen3-Next-80B-A3B").target
    return TargetModel(load_model(ModelSpec("twin", "config", twin.arch, dtype, device, twin.config, None), seed=0))


@contextmanager
def flat_layers():
    """Each block's region unwrapped: dynamo inlines every layer, as the whole-model compile did."""
    from remote_worker.models import blocks, dflash

    classes = [(blocks.GDNBlock, "forward"), (blocks.AttentionBlock, "forward"), (dflash.DFlashLayer, "forward_fixed")]
    saved = [(cls, name, cls.__dict__[name]) for cls, name in classes]
    for cls, name, method in saved:
        setattr(cls, name, method.__marked_compile_region_fn__)
    try:
        yield
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


def measure(
    depth: int,
    model: str,
    flat: bool,
    device: str = "cpu",
    dtype: str = "float32",
    budgets: tuple[int, ...] = (16, 32, 64),
) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    from remote_worker.decoding.comparison import methods_for
    from remote_worker.decoding.compiled import compile_rounds
    from remote_worker.decoding.fixed_round import FixedRound
    from remote_worker.decoding.loop import decode_from, prefill

    if device == "cpu":
        torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    if model == "qwen3_next":
        target, drafter = next_twin(dtype, device), None
        methods = methods_for([])[:1]  # AR: the twin has no published draft
    else:
        target, drafter = twin_at(depth, dtype, device)
        methods = methods_for(list(budgets))
    if flat:
        methods = methods[:1]
    generator = torch.Generator().manual_seed(depth)
    prompt = torch.randint(0, 500, (40,), generator=generator).to(device)
    new_tokens = 16

    class NoDrafter:  # compile_rounds reads these of a drafter; AR needs none
        feature_layers = ()
        block_size = 1

        def new_context(self) -> None:
            return None

    started = time.perf_counter()
    with flat_layers() if flat else _nothing():
        compiled = compile_rounds(target, drafter or NoDrafter(), methods, prompt, len(prompt), new_tokens)
    if isinstance(compiled, str):
        raise SystemExit(f"torch.compile failed: {compiled}")
    total = time.perf_counter() - started
    hits = counters["inductor"]["fxgraph_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"]
    start = prefill(target, prompt, drafter, compiled.prefiller)
    reference_start = prefill(target, prompt, drafter)
    same = {}
    for method in methods:
        kwargs = dict(method=method.name, max_new_tokens=new_tokens, budget=method.budget,
                      drafter=drafter if method.drafts else None)  # fmt: skip
        fast = decode_from(target, start, rounds=compiled.rounds[method.scope], **kwargs).tokens
        same[method.scope] = fast == decode_from(target, reference_start, **kwargs).tokens
    recompiles = compiled.recompiles()
    breaks = {}
    for method in methods:
        fresh = FixedRound(target, method.name, compiled.rounds[method.scope].capacity,
                           drafter=drafter if method.drafts else None, budget=method.budget)  # fmt: skip
        breaks[method.scope] = torch._dynamo.explain(fresh.step)().graph_break_count
    return {
        "model": model,
        "device": device,
        "dtype": dtype,
        "depth": target.num_layers,
        "flat": flat,
        "compile_s": compiled.compile_seconds,
        "compile_s_total": total,
        "fx_cache_hits": hits,
        "fx_cache_misses": misses,
        "same_tokens_as_reference": same,
        "recompiles": recompiles,
        "graph_breaks": breaks,
    }


@contextmanager
def _nothing():
    yield


def _run(depth: int, cache: Path, flat: bool = False, model: str = "qwen3_6_27b") -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.compile_depth", "--depth", str(depth), "--cache", str(cache),
               "--model", model] + (["--flat"] if flat else [])  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_depth_figures(depths: tuple[int, ...] = (4, 16, 64)) -> dict[str, Any]:
    """Cold and warm at each depth, the flat AR round beside, and the Qwen3-Next twin."""
    rows = []
    for depth in depths:
        with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
            cold = _run(depth, Path(cache))
            warm = _run(depth, Path(cache))
        with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
            flat = _run(depth, Path(cache), flat=True)
        rows.append({"depth": depth, "cold": cold, "warm": warm, "flat": flat})
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
        moe = {"cold": _run(48, Path(cache), model="qwen3_next"), "warm": _run(48, Path(cache), model="qwen3_next")}
    return {"rows": rows, "qwen3_next": moe}


def compile_depth_table(results: dict[str, Any]) -> list[str]:
    graphs = list(results["rows"][0]["cold"]["compile_s"])
    lines = [
        "| model | layers | cache | " + " | ".join(f"{g} s" for g in graphs) + " | all | AR flat s "
        "| same tokens | recompiles | graph breaks |",
        "|---|---|---|" + "---|" * (len(graphs) + 5),
    ]

    def row(model: str, depth: int, side: str, run: dict, flat: dict | None) -> str:
        cells = " | ".join(f"{run['compile_s'][g]:.1f}" if g in run["compile_s"] else "–" for g in graphs)
        flat_cell = f"{flat['compile_s']['ar']:.1f}" if flat else "–"
        same = "yes" if all(run["same_tokens_as_reference"].values()) else "NO"
        return (f"| {model} | {depth} | {side} | {cells} | {run['compile_s_total']:.0f} | {flat_cell} | {same} "
                f"| {run['recompiles']} | {sum(run['graph_breaks'].values())} |")  # fmt: skip

    for entry in results["rows"]:
        lines.append(row("Qwen3.6-27B twin", entry["depth"], "cold", entry["cold"], entry["flat"]))
        lines.append(row("Qwen3.6-27B twin", entry["depth"], "warm", entry["warm"], None))
    moe = results["qwen3_next"]
    lines.append(row("Qwen3-Next twin (MoE)", moe["cold"]["depth"], "cold", moe["cold"], None))
    lines.append(row("Qwen3-Next twin (MoE)", moe["warm"]["depth"], "warm", moe["warm"], None))
    first, last = results["rows"][0], results["rows"][-1]
    ratio = {g: last["cold"]["compile_s"][g] / first["cold"]["compile_s"][g] for g in graphs}
    flat = last["flat"]["compile_s"]["ar"] / first["flat"]["compile_s"]["ar"]
    lines += [
        "",
        f"Cold compile at {last['depth']} layers over {first['depth']}: "
        + ", ".join(f"{g} ×{r:.2f}" for g, r in ratio.items())
        + f"; the AR round compiled flat (every layer inline) ×{flat:.2f}.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int)
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--flat", action="store_true")
    parser.add_argument("--model", default="qwen3_6_27b", choices=["qwen3_6_27b", "qwen3_next"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budgets", default="16,32,64", help="DDTree budgets, comma-separated")
    args = parser.parse_args()
    if args.depth is None:  # the whole figure, as `make bench` takes it
        results = compile_depth_figures()
        print(json.dumps(results))
        print("\n".join(compile_depth_table(results)))
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.cache)
    budgets = tuple(int(b) for b in args.budgets.split(","))
    print(json.dumps(measure(args.depth, args.model, args.flat, args.device, args.dtype, budgets)))


if __name__ == "__main__":
    main()
