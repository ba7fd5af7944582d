"""The paper's table by two phases against the paper's grid, on the trained tiny pair, side by side.

Both sides are the worker's own decode experiment (`run_ddtree_gdn`, in this process) over the same records of
one paper set (HumanEval's prompts, the first `records`), at temperature 0 and block size 16, measuring the
host's round costs as a run does:

- the grid: AR, DFlash and DDTree at the paper's seven budgets (16 … 1024) on every record;
- two phases (`decode.protocol=two_phase`): AR, DFlash and DDTree at 1024 on every `every`-th record, then
  DFlash and DDTree at the budget that sample predicts fastest on every record.

The jobs alternate (grid, two phases, grid, …: `passes` of each), so a machine that slows down slows both. A
side's time is its job's whole run (the model loaded, the costs measured, every decode); its decode time the
sum of its records' decodes. Counts that do not depend on the machine beside them: target rounds and verified
nodes per record (AR verifies 1 node a round, DFlash its block, DDTree its budget + 1).

Then the figures: the two-phase job's table cells (the sweep page's own code: AR predicted where it did not
run) against the grid's on the same records, each inside the grid's 95 % interval or not; the chosen budget
against the grid's best; and AR's prediction against AR decoded by the grid job on the records the sample left
out.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from orchestrator import CONF_DIR
from orchestrator.config.prompts import resolve_prompts
from orchestrator.sweep.paper.ar_prediction import ArCost, ArSample
from orchestrator.sweep.paper.figures import Cell, Record, best_ddtree, cell, read_records
from orchestrator.sweep.paper.table import JobRecords, entries
from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
from remote_worker.models.loading import load_tokenizer
from remote_worker.prompt_set import Prompt, to_jsonl
from remote_worker.prompts import token_ids
from remote_worker.spec import parse_spec

PAPER_GRID = (16, 32, 64, 128, 256, 512, 1024)
BLOCK = 16
SET = "humaneval_completion"
CONTEXT = 2048  # the tiny trained pair's


def _job(root: Path, name: str, decode: dict[str, Any], records: int, prompts: str) -> tuple[float, Path]:
    """One decode job in `root/name`: its wall time and its folder."""
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "prompts.jsonl").write_text(prompts, encoding="utf-8")
    started = time.perf_counter()
    run_ddtree_gdn(parse_spec(_raw(run_dir, name, decode, records), run_dir), EventLog(run_dir))
    return time.perf_counter() - started, run_dir


def _raw(run_dir: Path, name: str, decode: dict[str, Any], records: int) -> dict[str, Any]:
    """The spec of a decode job of the tiny trained pair on the CPU."""
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "tiny_trained.yaml"))
    assert isinstance(model, dict)
    model["device"] = "cpu"
    settings = {"temperature": 0.0, "block_size": BLOCK, "compile": False, "node_costs": True, **decode}
    return {"run_id": name, "run_dir": str(run_dir), "seed": 0, "model": model, "decode": settings,
            "experiment": {"name": "ddtree_gdn", "num_prompts": records, "prompts_file": "prompts.jsonl"}}  # fmt: skip


def _nodes(scope: str) -> int:
    """Nodes one round of `scope` verifies."""
    if scope == "ar":
        return 1
    if scope == "dflash":
        return BLOCK
    return int(scope.removeprefix("ddtree_tb")) + 1


def _counts(run_dir: Path, records: int) -> dict[str, float]:
    """Decodes, target rounds and verified nodes per record, from the job's rows."""
    decodes = rounds = nodes = 0
    for line in (run_dir / "generations.jsonl").read_text(encoding="utf-8").splitlines():
        for scope, out in json.loads(line)["methods"].items():
            decodes += 1
            rounds += int(out["rounds"])
            nodes += int(out["rounds"]) * _nodes(scope)
    return {"decodes": decodes / records, "rounds": rounds / records, "nodes": nodes / records}


def _decode_s(run_dir: Path) -> float:
    total = 0.0
    for line in (run_dir / "generations.jsonl").read_text(encoding="utf-8").splitlines():
        total += sum(float(out["decode_s"]) for out in json.loads(line)["methods"].values())
    return total


def _cell(c: Cell | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "budget": c.budget, "records": c.records, "speedup": c.speedup, "tau": c.tau,
        "speedup_ci": [c.speedup_ci.low, c.speedup_ci.high] if c.speedup_ci else None,
        "tau_ci": [c.tau_ci.low, c.tau_ci.high] if c.tau_ci else None,
    }  # fmt: skip


def _inside(value: float, grid: Cell, what: str) -> bool:
    interval = grid.speedup_ci if what == "speedup" else grid.tau_ci
    return interval is not None and interval.low <= value <= interval.high


def _fitting(records: int, max_new_tokens: int) -> list[Prompt]:
    """The set's first `records` prompts that leave room for the new tokens and a 1024-node tree in the tiny
    pair's context of 2,048 (its byte-level tokenizer makes a long HumanEval prompt over 1,000 tokens)."""
    spec = parse_spec(_raw(Path("/"), "probe", {}, 1), Path("/")).model
    tokenizer = load_tokenizer(spec)
    room = CONTEXT - max_new_tokens - (max(PAPER_GRID) + 1)
    fitting = [p for p in resolve_prompts(SET) if len(token_ids(p, tokenizer, 1 << 30)) <= room]
    if len(fitting) < records:
        raise ValueError(f"{SET} has {len(fitting)} prompts of at most {room} tokens, fewer than {records}")
    return fitting[:records]


def paper_protocol_figures(records: int = 128, every: int = 8, max_new_tokens: int = 32, passes: int = 2) -> dict:
    problems = _fitting(records, max_new_tokens)
    prompts = to_jsonl(problems)
    grid_s, two_s, grid_decode_s, two_decode_s = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="paper-protocol-") as folder:
        root = Path(folder)
        _job(root, "warm", {"max_new_tokens": 8, "tree_budgets": [16], "node_costs": False}, 1, prompts)
        grid_dir = two_dir = root
        for index in range(passes):
            seconds, grid_dir = _job(root, f"grid{index}", {"max_new_tokens": max_new_tokens,
                                     "tree_budgets": list(PAPER_GRID)}, records, prompts)  # fmt: skip
            grid_s.append(seconds)
            grid_decode_s.append(_decode_s(grid_dir))
            seconds, two_dir = _job(root, f"two{index}", {"max_new_tokens": max_new_tokens,
                                    "tree_budgets": [max(PAPER_GRID)], "protocol": "two_phase",
                                    "sample_every": every}, records, prompts)  # fmt: skip
            two_s.append(seconds)
            two_decode_s.append(_decode_s(two_dir))
        grid_rows = read_records((grid_dir / "generations.jsonl").read_text(encoding="utf-8").splitlines())
        two_rows = read_records((two_dir / "generations.jsonl").read_text(encoding="utf-8").splitlines())
        summary = json.loads((two_dir / "decode_summary.json").read_text(encoding="utf-8"))
        counts = {"paper_grid": _counts(grid_dir, records), "two_phase": _counts(two_dir, records)}
    (entry,) = entries([JobRecords("humaneval", 0.0, "tiny_trained", two_rows, summary)])
    assert entry.two_phase is not None
    grid_dflash, grid_best = cell(grid_rows, "dflash"), best_ddtree(grid_rows)
    assert grid_best is not None and entry.ddtree is not None and entry.dflash is not None
    chosen = entry.ddtree.budget
    ratios = [t / g for t, g in zip(two_s, grid_s, strict=True)]
    decode_ratios = [t / g for t, g in zip(two_decode_s, grid_decode_s, strict=True)]
    checks = {
        "dflash_speedup": _inside(entry.dflash.speedup, grid_dflash, "speedup"),
        "dflash_tau": _inside(entry.dflash.tau, grid_dflash, "tau"),
        "ddtree_speedup": _inside(entry.ddtree.speedup, grid_best, "speedup"),
        "ddtree_tau_vs_grid_at_chosen": (
            _inside(entry.ddtree.tau, cell(grid_rows, f"ddtree_tb{chosen}"), "tau")
            if f"ddtree_tb{chosen}" in grid_rows[0].methods else None
        ),
        "chosen_is_best_or_inside": chosen == grid_best.budget or _inside(entry.ddtree.speedup, grid_best, "speedup"),
    }  # fmt: skip
    return {
        "model": "tiny_trained",
        "prompts": f"{SET} (first {records})",
        "records": records,
        "every": every,
        "sample_records": entry.two_phase.sample_records,
        "max_new_tokens": max_new_tokens,
        "block_size": BLOCK,
        "passes": passes,
        "job_s": {"paper_grid": grid_s, "two_phase": two_s},
        "decode_s": {"paper_grid": grid_decode_s, "two_phase": two_decode_s},
        "time_ratio": _spread(ratios),
        "decode_time_ratio": _spread(decode_ratios),
        "per_record": counts,
        "count_ratio": {k: counts["two_phase"][k] / counts["paper_grid"][k] for k in ("decodes", "rounds", "nodes")},
        "chosen_budget": chosen,
        "grid": {"dflash": _cell(grid_dflash), "best_ddtree": _cell(grid_best)},
        "two_phase": {"dflash": _cell(entry.dflash), "ddtree": _cell(entry.ddtree)},
        "inside_grid_interval": checks,
        "ar_prediction": _ar_check(two_rows, grid_rows, entry),
        "choice": summary["protocol"]["line"],
    }


def _ar_check(two_rows: list[Record], grid_rows: list[Record], entry: Any) -> dict[str, Any]:
    """The two-phase job's AR fit (its sample) against AR decoded by the grid job on the records the sample left
    out; the fit's own leave-one-out error beside it."""
    sample = [ArSample(r.prompt_tokens, len(r.methods["ar"].tokens), r.methods["ar"].decode_s)
              for r in two_rows if "ar" in r.methods]  # fmt: skip
    fit = ArCost.fit(sample)
    left_out = {r.id for r in two_rows if "ar" not in r.methods}
    errors, predicted, measured = [], 0.0, 0.0
    for r in grid_rows:
        if r.id not in left_out:
            continue
        ar = r.methods["ar"]
        guess = fit.decode_s(r.prompt_tokens, len(ar.tokens))
        errors.append(guess / ar.decode_s - 1)
        predicted, measured = predicted + guess, measured + ar.decode_s
    check = entry.two_phase.check
    return {
        "step_ms": 1000 * fit.step_s,
        "per_context_us": 1e6 * fit.per_context_s,
        "held_out_records": len(errors),
        "held_out_error_median": statistics.median(abs(e) for e in errors) if errors else None,
        "held_out_error_total": predicted / measured - 1 if measured else None,
        "leave_one_out_median": check.median if check else None,
        "leave_one_out_total": check.total if check else None,
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paper_protocol_table(figures: dict[str, Any]) -> list[str]:
    ratio, decode_ratio, counts = figures["time_ratio"], figures["decode_time_ratio"], figures["per_record"]
    grid, two, ar = figures["grid"], figures["two_phase"], figures["ar_prediction"]
    inside = ", ".join(
        f"{k} {'yes' if v else 'no' if v is not None else '–'}" for k, v in figures["inside_grid_interval"].items()
    )

    def figure(c: dict[str, Any] | None) -> str:
        if c is None:
            return "–"
        s_ci, t_ci = c["speedup_ci"], c["tau_ci"]
        speedup = f"×{c['speedup']:.2f}" + (f" ({s_ci[0]:.2f}–{s_ci[1]:.2f})" if s_ci else "")
        return speedup + f" · τ {c['tau']:.2f}" + (f" ({t_ci[0]:.2f}–{t_ci[1]:.2f})" if t_ci else "")

    def seconds(side: str) -> str:
        values = figures["job_s"][side]
        return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"

    return [
        f"{figures['model']}, {figures['prompts']}, {figures['max_new_tokens']} new tokens, block size "
        f"{figures['block_size']}, temperature 0; each side a whole decode job, {figures['passes']} of each, "
        f"alternating; two phases sample every {figures['every']}th record ({figures['sample_records']} records).",
        "",
        "| side | job s (range) | decodes / record | target rounds / record | verified nodes / record |",
        "|---|---|---|---|---|",
        f"| paper's grid (AR, DFlash, DDTree 16 … 1024) | {seconds('paper_grid')} | "
        f"{counts['paper_grid']['decodes']:.2f} | {counts['paper_grid']['rounds']:.1f} | "
        f"{counts['paper_grid']['nodes']:.0f} |",
        f"| two phases (chose budget {figures['chosen_budget']}) | {seconds('two_phase')} | "
        f"{counts['two_phase']['decodes']:.2f} | {counts['two_phase']['rounds']:.1f} | "
        f"{counts['two_phase']['nodes']:.0f} |",
        "",
        f"Two phases ÷ grid: job time ×{ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f}), decode time "
        f"×{decode_ratio['median']:.2f} ({decode_ratio['min']:.2f}–{decode_ratio['max']:.2f}); rounds "
        f"×{figures['count_ratio']['rounds']:.2f}, verified nodes ×{figures['count_ratio']['nodes']:.2f}.",
        "",
        "| figure | paper's grid | two phases |",
        "|---|---|---|",
        f"| DFlash | {figure(grid['dflash'])} | {figure(two['dflash'])} |",
        f"| DDTree (grid: best of 7 at {grid['best_ddtree']['budget']}; two phases: chosen "
        f"{two['ddtree']['budget']}) | {figure(grid['best_ddtree'])} | {figure(two['ddtree'])} |",
        "",
        f"Inside the grid's 95 % interval: {inside}.",
        "",
        f"AR predicted from the sample's step cost ({ar['step_ms']:.3f} ms + {ar['per_context_us']:.3f} µs per "
        f"context token): on the {ar['held_out_records']} records it left out, against AR decoded there by the "
        f"grid job, median error {_percent(ar['held_out_error_median'])}, total "
        f"{_percent(ar['held_out_error_total'], True)}; "
        f"left out one at a time on the sample: median {_percent(ar['leave_one_out_median'])}, total "
        f"{_percent(ar['leave_one_out_total'], True)}.",
        "",
        f"The choice: {figures['choice']}",
    ]


def _percent(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "–"
    return f"{100 * value:+.1f} %" if signed else f"{100 * value:.1f} %"
