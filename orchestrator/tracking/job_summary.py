"""The job's own page in MLflow: its description (the summary table in Markdown), `summary.md`/`summary.csv`,
and the per-prompt generations as an MLflow table, from the files a decode sweep writes.

The headline metrics (`ar.tokens_per_s`, `ddtree_tb32.speedup_vs_ar`, `best.*`) come from the worker as
events; what is here is what a person reads: one row per method, in the worker's order.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.tracking.budget_table import budget_csv, budget_line, budget_markdown
from orchestrator.tracking.markdown_table import markdown_table
from remote_worker.decoding.figure_rules import MIN_PROMPTS, ONLINE, versus_best_fixed
from remote_worker.wording import counted

# The range beside the median tokens/s is printed at the median's own precision: rounding to one format keeps
# order, so the median shown always lies inside it (rounded to whole numbers, 8.55–9.2 read "9–9" beside 8.6).
TOKENS_PER_S = "{:.1f}"
RANGE = ("tokens_per_s_min", "tokens_per_s_max")

# The 95 % bootstrap intervals over prompts (remote_worker.decoding.bootstrap): a drafting method's, with two
# prompts or more; DDTree's speedup over DFlash, paired as every speedup over AR is.
TAU_CI = ("tau_ci_low", "tau_ci_high")
SPEEDUP_CI = ("speedup_vs_ar_ci_low", "speedup_vs_ar_ci_high")
VS_DFLASH = ("speedup_vs_dflash", "speedup_vs_dflash_ci_low", "speedup_vs_dflash_ci_high")

# (column, metric key, format) for the table; a column no method has (lossless at T > 0, the intervals of a
# one-prompt run) is left out, and a cell is blank where its method lacks the figure (AR's intervals).
COLUMNS = (
    ("tau", "tau", "{:.2f}"),
    ("tau 95% CI", TAU_CI, "{:.2f}–{:.2f}"),
    ("decode tok/s", "tokens_per_s", TOKENS_PER_S),
    ("range", RANGE, f"{TOKENS_PER_S}–{TOKENS_PER_S}"),
    ("speedup vs AR", "speedup_vs_ar", "×{:.2f}"),
    ("speedup 95% CI", SPEEDUP_CI, "×{:.2f}–{:.2f}"),
    ("vs DFlash", VS_DFLASH, "×{:.2f} ({:.2f}–{:.2f})"),
    ("tpot ms", "tpot_ms", "{:.2f}"),
    ("prefill ms", "prefill_ms", "{:.1f}"),
    ("lossless", "lossless", "{:.2f}"),
    ("divergences (near tie / unexplained)", ("near_tie_divergences", "unexplained_divergences"), "{:.0f} / {:.0f}"),
    ("repetition", "repetition_share", "{:.2f}"),
    ("peak MB", "peak_memory_mb", "{:.0f}"),
)
# What a cell shows where its method has only some of the column's figures: DDTree over DFlash on one prompt.
SHORTER = {VS_DFLASH: ("speedup_vs_dflash", "×{:.2f}")}
CSV_KEYS = (
    "tau",
    "tau_ci_low",
    "tau_ci_high",
    "acceptance_length_mean",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_max",
    "speedup_vs_ar",
    "speedup_vs_ar_min",
    "speedup_vs_ar_max",
    "speedup_vs_ar_ci_low",
    "speedup_vs_ar_ci_high",
    "speedup_vs_dflash",
    "speedup_vs_dflash_ci_low",
    "speedup_vs_dflash_ci_high",
    "speedup_vs_best_fixed",
    "speedup_vs_best_fixed_ci_low",
    "speedup_vs_best_fixed_ci_high",
    "best_fixed_budget",
    "tpot_ms",
    "prefill_ms",
    "ttft_ms",
    "lossless",
    "near_tie_divergences",
    "unexplained_divergences",
    "repetition_share",
    "tau_without_repetition",
    "rounds",
    "prompts",
    "peak_memory_mb",
)


@dataclass(frozen=True)
class JobSummary:
    markdown: str
    csv: str
    budget_csv: str | None = None  # every budget's tau and predicted tokens/s (`budget_table`); None: no curve


def summarize(document: dict[str, Any], title: str) -> JobSummary:
    """The description (and summary.md) and the CSV of `decode_summary.json`.

    MLflow 3.17 shows a description collapsed to its first three lines or so, so it leads with the answer,
    how `ddtree_online` did against the fastest fixed budget where it ran, the Best line (how far to trust
    it) and the Budget line (the budget this host should use), then the
    table, then the budget table. Its Markdown converter (showdown, GitHub flavour) reads a table only with
    a `| --- |` row under the header and a blank line before and after."""
    methods = document.get("methods") or []
    columns = [c for c in COLUMNS if any(cell(m, c[1], c[2]) for m in methods)]
    if not any(_has(m, RANGE) and m[RANGE[0]] != m[RANGE[1]] for m in methods):
        columns = [c for c in columns if c[1] != RANGE]  # one pass: no spread to show ("294.7–294.7")
    lines = [answer(methods), ""]
    online = online_line(methods)  # a run that asked for a budget per round asked how it did: shown uncollapsed
    if online:
        lines += [online, ""]
    best = best_line(methods, document.get("best") or {})
    if best:
        lines += [best, ""]
    budget = budget_line(document)
    if budget:
        lines += [budget, ""]
    lines += [f"**{title}**", ""]
    body = [[str(m.get("scope", "?")), *(cell(m, key, form) for _name, key, form in columns)] for m in methods]
    lines += markdown_table(["method", *(c[0] for c in columns)], body)
    notes = [note for note in (_interval_note(methods), host_line(document), _memory_note(document)) if note]
    if notes:
        lines += ["", *(f"{note}  " for note in notes)]
    section = budget_markdown(document)
    if section:
        lines += ["", *section]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["method", "tree_budget", *CSV_KEYS])
    for method in methods:
        writer.writerow([method.get("scope"), method.get("tree_budget"), *(method.get(k, "") for k in CSV_KEYS)])
    return JobSummary("\n".join(lines) + "\n", buffer.getvalue(), budget_csv(document))


def _interval_note(methods: list[dict[str, Any]]) -> str:
    """Why the table has no 95 % intervals, where the run had too few prompts for them."""
    prompts = max((int(m.get("prompts", 0)) for m in methods), default=0)
    if not 0 < prompts < MIN_PROMPTS or any(_has(m, SPEEDUP_CI) for m in methods):
        return ""
    return (f"No 95 % intervals: the figures rest on {counted(prompts, 'prompt')}, too few for one "
            f"(at least {MIN_PROMPTS}).")  # fmt: skip


def host_line(document: dict[str, Any]) -> str:
    """The host's load while the job decoded (`host_load` in decode_summary.json), beside its speeds: a busy
    host makes every speed on the page read low, and the line says so first."""
    load = document.get("host_load") or {}
    if not load.get("samples"):
        return ""
    parts = []
    if load.get("load_average_mean") is not None:
        parts.append(f"load average {load['load_average_mean']:.2f} (max {load['load_average_max']:.2f}) on "
                     f"{load.get('cpus', '?')} CPUs")  # fmt: skip
    if load.get("other_processes_cpu_percentage_mean") is not None:
        parts.append(f"other processes took {load['other_processes_cpu_percentage_mean']:.0f} % of the CPU time")
    if load.get("gpu_utilization_percentage_mean") is not None:
        parts.append(f"GPU 0 {load['gpu_utilization_percentage_mean']:.0f} % busy")
    text = f"Host while decoding: {', '.join(parts)} ({counted(load['samples'], 'sample')}; System metrics tab)."
    if load.get("busy"):
        share = load.get("busy_share", 25)
        text = f"**Host busy**: other processes took over {share:.0f} % of the CPU time: the speeds read low. {text}"
    return text


def _memory_note(document: dict[str, Any]) -> str:
    measures = document.get("peak_memory_measures")
    return f"peak MB: {measures}." if measures else ""


def answer(methods: list[dict[str, Any]]) -> str:
    """The line that answers the job's question before any table (MLflow shows a description's first lines
    collapsed): the fastest DDTree and DFlash against AR, e.g. `DDTree-32: tau 4.53, ×2.13 vs AR, lossless ·
    DFlash: tau 3.42, ×1.99 vs AR, lossless`."""
    trees = [m for m in methods if m.get("method") == "ddtree" and _has(m, "speedup_vs_ar")]
    shown = [max(trees, key=lambda m: m["speedup_vs_ar"])] if trees else []
    shown += [m for m in methods if m.get("method") in (ONLINE, "dflash") and _has(m, "speedup_vs_ar")]
    parts = []
    for method in shown:
        names = {"ddtree": f"DDTree-{method.get('tree_budget')}", ONLINE: "DDTree-online"}
        name = names.get(str(method.get("method")), "DFlash")
        text = f"**{name}**: tau {method.get('tau', 0):.2f}, ×{method['speedup_vs_ar']:.2f} vs AR"
        if _has(method, "lossless"):
            text += ", lossless" if method["lossless"] == 1 else f", lossless {method['lossless']:.2f}"
        parts.append(text)
    return " · ".join(parts) or "No drafting method ran: nothing to compare with AR."


def online_line(methods: list[dict[str, Any]]) -> str:
    """Where `ddtree_online` ran, how it did against the fixed budget that decoded fastest on the same prompts,
    said plainly (`figure_rules.versus_best_fixed`, as the terminal says it): `**DDTree-online** ran ×0.97
    (0.91–1.03) the speed of DDTree-32, the fastest fixed budget here (picked after the fact): level with it
    within the 95 % interval.`"""
    online = next((m for m in methods if m.get("method") == ONLINE), None)
    said = versus_best_fixed(online) if online is not None else ""
    return f"**DDTree-online** {said}." if said else ""


def method_note(method: dict[str, Any], title: str) -> str:
    """A method's own run's description: its figures in one line, and where the comparison is (its job's page):
    `**ddtree_tb16** · tiny_trained · float32 · T=0 · local: tau 4.00 (2.99–5.45), ×2.02 (1.58–2.72) vs AR,
    901.0 tok/s, lossless 1.00.`"""
    figures = []
    shown = (("tau", "tau_ci_low", "tau_ci_high", "tau {:.2f}"),
             ("speedup_vs_ar", "speedup_vs_ar_ci_low", "speedup_vs_ar_ci_high", "×{:.2f}"))  # fmt: skip
    for key, low, high, form in shown:
        if _has(method, key) and method.get("method") != "ar":  # AR's are 1 by definition
            text = form.format(method[key])
            if _has(method, (low, high)):
                text += f" ({method[low]:.2f}–{method[high]:.2f})"
            figures.append(text + (" vs AR" if key == "speedup_vs_ar" else ""))
    if _has(method, "tokens_per_s"):
        figures.append(f"{method['tokens_per_s']:.1f} tok/s")
    if _has(method, "lossless") and method.get("method") != "ar":
        figures.append(f"lossless {method['lossless']:.2f}")
    said = ", ".join(figures) or "no figures"
    return f"**{method.get('scope', '?')}** · {title}: {said}. Its job's page compares it with the other methods."


def best_line(methods: list[dict[str, Any]], best: dict[str, Any]) -> str:
    """The worker's verdict (`best` in decode_summary.json): the method it names, with the basis that says how
    far to trust it (its interval clears the runner-up's, slower than AR), or, where it names none, why (`no
    method is clearly ahead …`, too few prompts for an interval). Empty for a summary written before the
    worker judged."""
    chosen = next((m for m in methods if best.get("scope") and m.get("scope") == best["scope"]), None)
    basis = str(best.get("basis") or "")
    if chosen is None:
        return f"Best: {basis}." if basis else ""
    figures = f"×{chosen.get('speedup_vs_ar', 0):.2f} vs AR at tau {chosen.get('tau', 0):.2f}"
    return f"Best: **{chosen['scope']}**, {figures}" + (f" — {basis}." if basis else ".")


def generation_rows(path: Path) -> dict[str, list[Any]]:
    """`generations.jsonl` as table columns, one row per (prompt, method): what the UI's table view shows."""
    columns: dict[str, list[Any]] = {
        k: [] for k in ("prompt_id", "method", "prompt", "output", "tau", "rounds", "matches_ar", "divergence")
    }
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            for scope, out in (row.get("methods") or {}).items():
                divergence = out.get("divergence")
                columns["prompt_id"].append(str(row.get("id")))
                columns["method"].append(scope)
                columns["prompt"].append(str(row.get("prompt", "")))
                text = str(out.get("text", ""))
                columns["output"].append(text if text.strip() else repr(text))  # whitespace alone: shown, not blank
                columns["tau"].append(round(float(out.get("tau") or 0.0), 2))
                columns["rounds"].append(int(out.get("rounds") or 0))
                columns["matches_ar"].append("" if out.get("matches_ar") is None else str(out["matches_ar"]))
                columns["divergence"].append(json.dumps(divergence) if divergence else "")
    return columns


def _has(method: dict[str, Any], key: str | tuple[str, ...]) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return all(isinstance(method.get(k), (int, float)) for k in keys)


def cell(method: dict[str, Any], key: str | tuple[str, ...], form: str) -> str:
    """A table cell of a method's figures (`key`: one metric or several, for `form`): blank where the method
    lacks them, `SHORTER`'s form where it has only the first (DDTree over DFlash without its interval). The
    sweep's description formats its interval columns with it too."""
    if not _has(method, key) and key in SHORTER:
        key, form = SHORTER[key]
    if not _has(method, key):
        return ""
    keys = key if isinstance(key, tuple) else (key,)
    return form.format(*(method[k] for k in keys))


def prompt_dataset(path: Path, name: str) -> Any:
    """The run's prompt set as an MLflow dataset input (the UI lists it under the run's Datasets): its name,
    a digest of the exact file, where it came from, and how many prompts it holds."""
    import hashlib

    from mlflow.entities import Dataset, DatasetInput, InputTag

    data = path.read_bytes()
    rows = [line for line in data.decode("utf-8", errors="replace").split("\n") if line.strip()]  # JSON Lines: \n only
    schema = {"mlflow_colspec": [{"name": "id", "type": "string"}, {"name": "messages", "type": "string"}]}
    dataset = Dataset(
        name=name,
        digest=hashlib.sha256(data).hexdigest()[:12],
        source_type="local",
        source=json.dumps({"uri": name}),
        schema=json.dumps(schema),
        profile=json.dumps({"num_rows": len(rows)}),
    )
    return DatasetInput(dataset=dataset, tags=[InputTag(key="mlflow.data.context", value="prompts")])
