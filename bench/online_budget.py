"""`ddtree_online` against the best fixed budget, per paper set and temperature, on the trained tiny pair.

The ten paper sets' prompts come through the real loader from a mirror in the hub's layout, built here with the
synthetic rows the tests use (`tests/paper_mirror.py`: no hub is reachable from this machine, so the prompts
are formulaic and the tiny pair's outputs on them are whatever it makes of them). Per set and temperature, one
decode job of the worker (`run_ddtree_gdn`, in this process): AR, DFlash, DDTree at every budget of GRID and
`ddtree_online` (its tree grown to the largest budget), every method on the same records, taking turns per
record, the round costs measured between records as a run does (they feed the online policy).

The comparison: `ddtree_online`'s tokens/s over the records against the fixed budget that measured fastest on
the same records (a maximum of noisy measurements, which favours the grid), as a ratio with a 95 % paired
bootstrap interval over records. "Ahead" means the interval lies above 1.

Beside it, per job, the replay (`bench.online_replay`): the same records' first turns decoded once at the largest
budget, every round kept, and replayed against the job's own node costs: how far any per-round choice could get
ahead of the best fixed budget on those rounds (the oracle, which knows each round's outcome), and how far the
policy gets without timing noise. It tells a policy that chooses badly from one whose choices are eaten by cost.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.online_replay import record_rounds, replay
from bench.paper_protocol import BLOCK, _raw
from orchestrator.config import paper_datasets
from orchestrator.config.paper_datasets import PAPER_SET_NAMES, load_paper_set
from remote_worker.decoding.node_cost import NodeCosts
from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import load_pair, run_ddtree_gdn
from remote_worker.models.loading import load_tokenizer
from remote_worker.prompt_set import load_prompt_file, to_jsonl
from remote_worker.prompts import encode
from remote_worker.spec import parse_spec

GRID = (8, 16, 32, 64)
RESAMPLES = 2000


def online_budget_figures(
    records: int = 12,
    max_new_tokens: int = 32,
    sets: tuple[str, ...] = PAPER_SET_NAMES,
    cost_repeats: int = 2,
    compiled: bool = False,
) -> dict[str, Any]:
    """`compiled`: every job with `decode.compile=true` (`ddtree_online` on its compiled round, one draft and one
    verify graph per budget of GRID); no replay then (it prices rounds with eager node costs, which a compiled
    job does not measure)."""
    import datasets
    import torch

    from tests.paper_mirror import build_mirror

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="online-budget-") as folder:
        root = Path(folder)
        datasets.config.HF_DATASETS_CACHE = str(root / "hf-cache")
        mirror = build_mirror(root / "mirror", rows_per_set=records)
        pair_dir = root / "pair"  # the pair the replay decodes with, loaded as a job loads it
        pair_dir.mkdir()
        pair_spec = parse_spec(_raw(pair_dir, "pair", {}, records), pair_dir)
        _, target, drafter = load_pair(pair_spec, EventLog(pair_dir))
        tokenizer = load_tokenizer(pair_spec.model)
        for name in sets:
            paper_datasets._load.cache_clear()
            prompts = to_jsonl(load_paper_set(name, mirror)[:records])
            for temperature in (0.0, 1.0):
                run_dir = root / f"{name}-t{temperature:g}"
                run_dir.mkdir()
                (run_dir / "prompts.jsonl").write_text(prompts, encoding="utf-8")
                decode = {"max_new_tokens": max_new_tokens, "tree_budgets": list(GRID), "online_budget": True,
                          "temperature": temperature, "node_cost_repeats": cost_repeats,
                          "compile": compiled}  # fmt: skip
                torch._dynamo.reset()  # each job compiles its own rounds: dynamo's limit counts graphs per code object
                run_ddtree_gdn(parse_spec(_raw(run_dir, run_dir.name, decode, records), run_dir), EventLog(run_dir))
                row = _compare(name, temperature, run_dir)
                if compiled:
                    row["replay"] = None
                    rows.append(row)
                    continue
                conversations = load_prompt_file(run_dir / "prompts.jsonl")
                ids = [encode(c, tokenizer, target.embed.num_embeddings) for c in conversations]
                rounds = record_rounds(target, drafter, ids, max(GRID), temperature, max_new_tokens)
                costs = NodeCosts.from_record(json.loads((run_dir / "decode_summary.json").read_text())["node_costs"])
                row["replay"] = replay(rounds, GRID, costs)
                rows.append(row)
    ahead = [r for r in rows if r["ratio_ci"][0] > 1]
    behind = [r for r in rows if r["ratio_ci"][1] < 1]
    return {
        "model": "tiny_trained",
        "compiled": compiled,
        "records": records,
        "max_new_tokens": max_new_tokens,
        "block_size": BLOCK,
        "grid": list(GRID),
        "node_cost_repeats": cost_repeats,
        "rows": rows,
        "ahead": len(ahead),
        "behind": len(behind),
        "ahead_at_t0": sum(1 for r in ahead if r["temperature"] == 0),
        "ahead_at_t1": sum(1 for r in ahead if r["temperature"] == 1),
    }


def _compare(name: str, temperature: float, run_dir: Path) -> dict[str, Any]:
    """Online against the fastest fixed budget on the job's records: the ratio of tokens/s and its interval."""
    records = [json.loads(line)["methods"] for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    fixed = [f"ddtree_tb{b}" for b in GRID]

    def speed(scope: str, sample: list[dict[str, Any]]) -> float:
        tokens = sum(len(r[scope]["tokens"]) for r in sample)
        return tokens / sum(float(r[scope]["decode_s"]) for r in sample)

    best = max(fixed, key=lambda scope: speed(scope, records))
    ratio = speed("ddtree_online", records) / speed(best, records)
    rng = random.Random(0)
    draws = sorted(
        speed("ddtree_online", s) / speed(best, s)
        for s in ([rng.choice(records) for _ in records] for _ in range(RESAMPLES))
    )
    summary = json.loads((run_dir / "decode_summary.json").read_text())
    policy = summary["online_budget"]["ddtree_online"]
    taus = {m["scope"]: m["tau"] for m in summary["methods"]}
    return {
        "dataset": name,
        "temperature": temperature,
        "best_fixed": int(best.removeprefix("ddtree_tb")),
        "ratio": ratio,
        "ratio_ci": [draws[int(0.025 * RESAMPLES)], draws[int(0.975 * RESAMPLES) - 1]],
        "tau_online": taus["ddtree_online"],
        "tau_best": taus[best],
        "rounds_at_budget": policy["rounds_at_budget"],
        "lossless": next(m.get("lossless") for m in summary["methods"] if m["scope"] == "ddtree_online"),
    }


def online_budget_table(figures: dict[str, Any]) -> list[str]:
    lines = [
        f"{figures['model']}, the ten paper sets from a mirror of synthetic rows, {figures['records']} records "
        f"each, {figures['max_new_tokens']} new tokens, block size {figures['block_size']}; fixed budgets "
        f"{', '.join(map(str, figures['grid']))}; one job per set and temperature.",
        "",
        "| dataset | T | best fixed | online ÷ best (95 % interval) | τ online | τ best | budgets chosen (rounds) "
        "| replay: oracle, online, raw ÷ best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["rows"]:
        chosen = ", ".join(f"{n}: {c}" for n, c in r["rounds_at_budget"].items())
        replayed = r["replay"]
        replay_cell = "—" if replayed is None else (
            f"×{replayed['oracle_vs_best']:.2f}, ×{replayed['online_vs_best']:.2f}, ×{replayed['raw_vs_best']:.2f}"
        )  # fmt: skip
        lines.append(
            f"| {r['dataset']} | {r['temperature']:g} | {r['best_fixed']} | ×{r['ratio']:.2f} "
            f"({r['ratio_ci'][0]:.2f}–{r['ratio_ci'][1]:.2f}) | {r['tau_online']:.2f} | {r['tau_best']:.2f} | "
            f"{chosen} | {replay_cell} |"
        )
    ratios = [r["ratio"] for r in figures["rows"]]
    lines += [
        "",
        f"{'Compiled rounds (decode.compile=true). ' if figures.get('compiled') else ''}Ahead beyond the interval "
        f"in {figures['ahead']} of {len(figures['rows'])} (T=0: {figures['ahead_at_t0']}, T=1: "
        f"{figures['ahead_at_t1']}); behind beyond it in {figures['behind']}; median ratio "
        f"×{statistics.median(ratios):.2f} (×{min(ratios):.2f}–×{max(ratios):.2f}).",
    ]
    replays = [r["replay"] for r in figures["rows"] if r["replay"] is not None]
    if replays:
        ceiling = [r["oracle_vs_best"] for r in replays]
        replayed = [r["online_vs_best"] for r in replays]
        lines[-1] += (
            " Replayed on the same sets' rounds against the node costs: the best any per-round choice could do, "
            f"median ×{statistics.median(ceiling):.2f} (×{min(ceiling):.2f}–×{max(ceiling):.2f}); the policy, "
            f"median ×{statistics.median(replayed):.2f}."
        )
    return lines
