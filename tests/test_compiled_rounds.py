"""Compiled fixed-shape rounds at the real depth: each kind of layer is traced once, however deep the model
(`remote_worker.models.blocks`), and the compiled prefill and DDTree round emit AR's tokens.

Compiling takes a minute or so per model on a CPU, so those are `slow` tests of `make test` only; the oldest
supported transformers (`make test-compat`) compiles one model, in `tests/test_fixed_round.py` (this module
is not marked `worker`, so it does not run there)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch._dynamo.utils import counters

from remote_worker.decoding.fixed_prefill import FixedPrefill
from remote_worker.decoding.fixed_round import FixedRound
from remote_worker.decoding.loop import decode, decode_from, fixed_capacity, prefill
from tests.tiny_models import random_prompt, tiny


def traced_regions(step) -> tuple[Counter, int]:
    """Trace `step` as a compiled round is traced (fullgraph, fixed shapes; dynamo only, nothing generated):
    how many times each traced region is called, and how many distinct regions were traced."""
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    torch.compile(step, backend=keep, fullgraph=True, dynamic=False)()
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    return Counter(call.args[1] for call in calls), len({call.args[0].target for call in calls})


@pytest.mark.parametrize("case_id", ["Qwen3.6-27B-DFlash", "Qwen3-8B-DFlash-b16", "Qwen3-Next-80B-A3B"])
def test_a_round_at_the_published_depth_traces_each_kind_of_layer_once(case_id: str) -> None:
    """A DDTree round of the full-depth twin (64 layers: 48 GDN + 16 attention; the dense control: 36) calls
    one traced region per kind of layer — GDN, attention, the drafter's windowed layers — for every layer
    of that kind: what is compiled does not grow with the depth. (A kind with one layer, the drafter's full
    layer, is inlined by dynamo: there is nothing to reuse.) Qwen3-Next, which has no published draft,
    decodes AR here, its mixture of experts inside the blocks."""
    from tests.test_twins import FULL_CASES, draft_twin, target_twin

    target = target_twin(FULL_CASES[case_id].target.name, "float32", full_depth=True)
    draft = draft_twin(case_id, "float32", full_depth=True)
    kinds = Counter(target.kinds)
    layers = draft.layers if draft is not None else []
    drafter_kinds = Counter((layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in layers)
    if draft is None:
        rounds = FixedRound(target, "ar", 256)
    else:
        rounds = FixedRound(target, "ddtree", 256, drafter=draft, budget=8)
    calls, traced = traced_regions(rounds.step)
    repeated = [count for count in [*kinds.values(), *drafter_kinds.values()] if count > 1]
    assert sorted(calls.values()) == sorted(repeated)
    assert traced == len(calls) == len(repeated)
    assert target.num_layers == FULL_CASES[case_id].target.config["num_hidden_layers"] >= 36


@pytest.mark.slow
def test_the_mixture_of_experts_twin_at_full_depth_compiles_and_emits_ar_tokens() -> None:
    """The Qwen3-Next twin, all 48 layers (sparse experts, 10 routed of 20, a gated shared expert): the compiled
    prefill and AR round (fullgraph: a break is an error) emit the reference AR's tokens, and a second
    prompt compiles nothing."""
    from tests.test_twins import FULL_CASES, prompt, target_twin

    torch._dynamo.reset()
    target = target_twin(FULL_CASES["Qwen3-Next-80B-A3B"].target.name, "float32", full_depth=True)
    assert target.compile_problem() is None and all(mlp.moe is not None for mlp in target.mlps)
    prompts = [prompt(3, 9), prompt(4, 14)]
    rounds = FixedRound(target, "ar", fixed_capacity(14, 8, 1, 0))
    prefiller = FixedPrefill(target, 256, 8)
    rounds.compile()
    prefiller.compile()
    graphs = []
    for prompt_tokens in prompts:
        start = prefill(target, prompt_tokens, None, prefiller)
        result = decode_from(target, start, method="ar", max_new_tokens=8, rounds=rounds)
        assert result.tokens == decode(target, prompt_tokens, method="ar", max_new_tokens=8).tokens
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]


def test_a_prefill_chunk_traces_each_kind_of_layer_once() -> None:
    from tests.test_twins import draft_twin, target_twin

    target = target_twin("Qwen3.6-27B", "float32", full_depth=True)
    prefiller = FixedPrefill(target, 256, 16, draft_twin("Qwen3.6-27B-DFlash", "float32", True).feature_layers)
    prefiller.count.fill_(16)
    calls, traced = traced_regions(prefiller.step)
    assert sorted(calls.values()) == [16, 48] and traced == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,dtype,full_depth",
    # tiny_hybrid in float32 is `test_the_compiled_round_is_one_graph_compiled_once`; the Qwen3.6-27B twin has
    # the real head layout (16 GDN key heads, 48 value heads), a windowed five-layer drafter and, here, all
    # 64 layers of the published model (the same twin at a reduced depth was a case of its own: this one holds it)
    [
        ("tiny_hybrid", "float64", False),
        ("tiny_dense", "float32", False),
        ("Qwen3.6-27B-DFlash", "float32", True),
    ],
)
def test_compiled_rounds_emit_ar_tokens(name: str, dtype: str, full_depth: bool) -> None:
    """The compiled prefill and DDTree round (fullgraph: a break is an error) decode two prompts exactly as AR
    does; the second compiles nothing. (At the published depth this caught a dropped K/V write: see
    `FixedPrefill.step`.)"""
    torch._dynamo.reset()  # a code object's graphs count against dynamo's limit, across this process's tests
    if name.startswith("tiny"):
        target, draft = tiny(name, dtype)
        prompts = [random_prompt(4), random_prompt(11)]
    else:
        from tests.test_twins import FULL_CASES, draft_twin, prompt, target_twin

        target = target_twin(FULL_CASES[name].target.name, dtype, full_depth)
        draft = draft_twin(name, dtype, full_depth)
        prompts = [prompt(1, 9), prompt(2, 14)]
    capacity = fixed_capacity(max(p.shape[0] for p in prompts), 10, draft.block_size, 8)
    rounds = FixedRound(target, "ddtree", capacity, drafter=draft, budget=8)
    prefiller = FixedPrefill(target, 256, 8, draft.feature_layers)
    rounds.compile()
    prefiller.compile()
    graphs = []
    for prompt_tokens in prompts:
        start = prefill(target, prompt_tokens, draft, prefiller)
        result = decode_from(target, start, method="ddtree", max_new_tokens=10, drafter=draft, budget=8, rounds=rounds)
        assert result.tokens == decode(target, prompt_tokens, method="ar", max_new_tokens=10).tokens
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]


@pytest.mark.slow
def test_a_second_worker_on_the_same_work_folder_compiles_from_the_hosts_cache(tmp_path) -> None:
    """Two worker processes, one after the other, each a run in WORKDIR/runs/: the first fills
    WORKDIR/compile-cache.<user> (`compile_cache: miss`), the second compiles every graph from it (`hit`), and both
    emit the same tokens. (The dense control and one prompt: the cache is the point, not the layers; the hybrid's
    compiled rounds are `test_compiled_rounds_emit_ar_tokens` and `test_fixed_round`'s.)"""
    import json
    import os
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from orchestrator import CONF_DIR
    from orchestrator.config.paths import PROJECT_ROOT
    from orchestrator.stream.events import split_events
    from remote_worker.decoding.compile_cache import cache_root
    from remote_worker.experiments.ddtree_gdn import GENERATIONS_FILE

    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "tiny_dense.yaml"))

    def run(name: str, cache: bool) -> tuple[dict, list]:
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        spec = {
            "run_id": name, "run_dir": str(run_dir), "seed": 0,
            "experiment": {"name": "ddtree_gdn", "num_prompts": 1},
            "model": {**model, "device": "cpu"},
            "decode": {"max_new_tokens": 10, "tree_budgets": [4], "compile": True, "compile_cache": cache,
                       "node_costs": False},
        }  # fmt: skip
        (run_dir / "spec.json").write_text(json.dumps(spec))
        # started as the orchestrator starts it: in its run folder, the spec named relatively
        command = [sys.executable, "-m", "remote_worker", "run", "spec.json"]
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
        done = subprocess.run(command, cwd=run_dir, env=env, check=False)
        assert done.returncode == 0, (run_dir / "events.jsonl").read_text()[-2000:]
        events = split_events((run_dir / "events.jsonl").read_bytes())[0]
        params = {k: v for e in events if e.kind == "params" and e.scope is None for k, v in e.data.items()}
        rows = [json.loads(line) for line in (run_dir / GENERATIONS_FILE).read_text().splitlines()]
        return params, [{m: out["tokens"] for m, out in row["methods"].items()} for row in rows]

    first, tokens = run("a", cache=True)
    cache = cache_root(tmp_path / "runs" / "a")
    entries = sorted(p.relative_to(tmp_path) for p in cache.rglob("*"))
    second, again = run("b", cache=True)
    assert (first["compile_cache"], second["compile_cache"]) == ("miss", "hit")
    assert tokens == again and entries
    assert sorted(p.relative_to(tmp_path) for p in cache.rglob("*")) >= entries


def test_a_long_compile_reports_progress_while_it_compiles() -> None:
    """`CompileProgress`: a line as each graph starts and then every `every` seconds from its own thread (so
    the orchestrator's stall warning never fires on a compile); the bar counts seconds, its total the time
    so far plus the graphs left at the mean time of those compiled."""
    import time

    from remote_worker.decoding.compiled import CompileProgress

    sent: list[tuple[int, int, str]] = []
    clock = CompileProgress(lambda done, total, message: sent.append((done, total, message)), graphs=3, every=0.05)
    with clock.graph("prefill"):
        deadline = time.monotonic() + 30
        while len(sent) < 3 and time.monotonic() < deadline:  # the ticker's lines come while this one works
            time.sleep(0.01)
    first = len(sent)
    with clock.graph("ar round"):
        pass
    assert first >= 3 and all(message.startswith("compiling the prefill (1/3) · 0:0") for _, _, message in sent[:first])
    assert sent[first][2] == "compiling the ar round (2/3) · 0:00"
    assert all(total >= done for done, total, _ in sent) and len(clock.took) == 2
