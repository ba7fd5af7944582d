"""The paper's table on a sweep's page: rows the datasets, columns T = 0 and T = 1 × DFlash and DDTree.

Built from what the sweep's jobs logged: each job run's params name its dataset (`experiment.prompts`), its
temperature and its shard; its `generations.jsonl` holds its records (`figures.py` computes the paper's
figures from them, the shards of one dataset merged into one set of records), its `decode_summary.json` the
budget curve (tau at every budget from the largest budget's trees, the predicted speed from the run's costs).

For a model the paper reports (`PAPER_MODELS`), the paper's own figures (`paper_figures.csv`, with its
source) sit beside ours.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from orchestrator.sweep.paper.ar_prediction import ArCheck, ar_times
from orchestrator.sweep.paper.figures import Cell, Record, best_ddtree, cell, ddtree_scopes, merge, read_records
from orchestrator.tracking.markdown_table import NBSP, markdown_table, unbreakable
from remote_worker.decoding.figure_rules import ONLINE, Interval
from remote_worker.wording import counted

DATASETS = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe-bench", "mt-bench",
            "alpaca")  # fmt: skip
TEMPERATURES = (0.0, 1.0)
PAPER_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)
# Our model config's name -> the paper's column for it (the dense controls the paper benchmarks).
PAPER_MODELS = {"qwen3_4b": "Qwen3-4B", "qwen3_8b": "Qwen3-8B", "qwen3_coder_30b_a3b": "Qwen3-Coder-30B-A3B-Instruct"}
FIGURES_FILE = "paper_figures.csv"
CSV_COLUMNS = ("dataset", "temperature", "method", "tree_budget", "records", "speedup", "speedup_ci_low",
               "speedup_ci_high", "tau", "tau_ci_low", "tau_ci_high", "paper_speedup", "paper_tau")  # fmt: skip


@dataclass(frozen=True)
class PaperFigure:
    speedup: float
    tau: float


def paper_figures() -> dict[tuple[str, str, float, str], PaperFigure]:
    """(paper model, dataset, temperature, method) -> the paper's figure, from the data file shipped here."""
    text = resources.files("orchestrator.sweep.paper").joinpath(FIGURES_FILE).read_text(encoding="utf-8")
    rows = csv.DictReader(line for line in io.StringIO(text) if not line.startswith("#"))
    return {
        (r["paper_model"], r["dataset"], float(r["temperature"]), r["method"]): PaperFigure(
            float(r["speedup"]), float(r["tau"])
        )
        for r in rows
    }


@dataclass(frozen=True)
class JobRecords:
    """What one job of the sweep gives the table."""

    dataset: str
    temperature: float
    model: str
    records: list[Record]
    summary: Mapping | None = None  # its decode_summary.json


@dataclass(frozen=True)
class Missing:
    """A (dataset, temperature) of the sweep with no finished job: it keeps its row, saying why."""

    dataset: str
    temperature: float
    reason: str


@dataclass
class Entry:
    """One (dataset, temperature): the merged records' cells, and the budget curve."""

    dataset: str
    temperature: float
    records: int
    dflash: Cell | None
    ddtree: Cell | None
    curve: dict[int, tuple[float, float | None]] = field(default_factory=dict)  # budget -> (tau, predicted ×)
    jobs: int = 1
    measured: dict[int, Cell] = field(default_factory=dict)  # each decoded budget's own cell, beside the curve's
    curve_withheld: tuple[str, ...] = ()  # why a job's curve was left out (a decode shorter than a draft block)
    two_phase: TwoPhase | None = None  # how the two-phase protocol made the cells (None: every record decoded all)
    online: Cell | None = None  # `ddtree_online` (a budget per round), where every record decoded it
    online_vs_best: Cell | None = None  # its speed over DDTree's best budget's on the same records (`speedup`)


@dataclass(frozen=True)
class TwoPhase:
    """A (dataset, temperature) decoded in two phases (`decoding.two_phase`): the budget(s) its jobs chose,
    where AR was predicted and how well the prediction did on the records AR decoded."""

    chosen: tuple[int, ...]  # the budget each job chose (one per shard), distinct, increasing
    sample_records: int  # records AR decoded (phase 1)
    predicted: int  # records whose AR time is predicted
    check: ArCheck | None  # the AR fit's leave-one-out error on the sample
    prediction_error: float | None  # the budget prediction's worst error at the decoded budgets (phase 1's)
    faster: tuple[tuple[int, float], ...] = ()  # budgets the curve predicts faster than the chosen one measured


def curve_of(summaries: Sequence[Mapping | None]) -> dict[int, tuple[float, float | None]]:
    """Tau and predicted speedup at the paper's budgets, from the jobs' budget curves (shards averaged, each
    weighted by its records). A budget past a curve's end is left out."""
    found: dict[int, list[tuple[float, float | None, int]]] = {}
    for summary in summaries:
        if not summary or not summary.get("budget_curve"):
            continue
        taus = summary["budget_curve"].get("tau") or []
        prediction = summary.get("prediction") or {}
        speeds, ar = prediction.get("tokens_per_s") or [], prediction.get("ar_predicted_tokens_per_s") or 0
        weight = int(max((m.get("prompts", 0) for m in summary.get("methods", [])), default=0)) or 1
        for budget in PAPER_BUDGETS:
            if budget <= len(taus):
                speed = speeds[budget - 1] / ar if ar and budget <= len(speeds) else None
                found.setdefault(budget, []).append((float(taus[budget - 1]), speed, weight))
    curve = {}
    for budget, values in sorted(found.items()):
        total = sum(w for _, _, w in values)
        tau = sum(t * w for t, _, w in values) / total
        speeds = [(s, w) for _, s, w in values if s is not None]
        speed = sum(s * w for s, w in speeds) / sum(w for _, w in speeds) if speeds else None
        curve[budget] = (tau, speed)
    return curve


def entries(jobs: Sequence[JobRecords]) -> list[Entry]:
    """One entry per (dataset, temperature) the jobs cover, in the paper's order."""
    groups: dict[tuple[str, float], list[JobRecords]] = {}
    for job in jobs:
        groups.setdefault((job.dataset, job.temperature), []).append(job)
    found = []
    for (dataset, temperature), group in sorted(groups.items(), key=lambda g: (_order(g[0][0]), g[0][1])):
        withheld = tuple(str(j.summary["curve_withheld"]) for j in group if (j.summary or {}).get("curve_withheld"))
        curve = curve_of([job.summary for job in group])
        if any(_chosen(job) is not None for job in group):
            found.append(_two_phase_entry(dataset, temperature, group, curve, withheld))
            continue
        records = merge([job.records for job in group])
        complete = [r for r in records if "ar" in r.methods]
        dflash = cell(complete, "dflash") if complete and all("dflash" in r.methods for r in complete) else None
        measured = {b: cell(complete, scope, b) for scope, b in ddtree_scopes(complete).items()} if complete else {}
        best = best_ddtree(complete)
        entry = Entry(dataset, temperature, len(complete), dflash, best, curve, len(group), measured, withheld)
        if best is not None and all(ONLINE in r.methods for r in complete):
            entry.online = cell(complete, ONLINE)
            entry.online_vs_best = cell(
                complete, ONLINE, ar=[r.methods[best.method].seconds_per_token for r in complete]
            )
        found.append(entry)
    return found


CHOSEN = "ddtree_chosen"  # a two-phase record's decode at the budget its job chose, whichever that was


def _chosen(job: JobRecords) -> int | None:
    """The budget a two-phase job chose (its summary's `protocol`); None for a job of the grid protocol."""
    protocol = (job.summary or {}).get("protocol")
    if not isinstance(protocol, Mapping) or protocol.get("kind") != "two_phase":
        return None
    budget = protocol.get("chosen_budget")
    return budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else None


def _two_phase_entry(
    dataset: str, temperature: float, group: Sequence[JobRecords], curve: dict, withheld: tuple[str, ...]
) -> Entry:
    """The cells of a dataset decoded in two phases: DFlash and DDTree at the chosen budget over every record, AR
    measured on the sample and predicted elsewhere (`ar_prediction`); the largest budget's cell over the
    sample beside the curve."""
    budgets = sorted({b for job in group if (b := _chosen(job)) is not None})
    shards = []
    for job in group:
        chosen = _chosen(job)
        scope = f"ddtree_tb{chosen}"
        shards.append([Record(r.id, {**r.methods, CHOSEN: r.methods[scope]}, r.prompt_tokens)
                       if scope in r.methods else r for r in job.records])  # fmt: skip
    records = [r for r in merge(shards) if CHOSEN in r.methods and "dflash" in r.methods]
    try:
        ar = ar_times(records)
    except ValueError:  # too few records AR decoded to fit its cost: no speedup can be told
        return Entry(dataset, temperature, len(records), None, None, curve, len(group), {}, withheld,
                     TwoPhase(tuple(budgets), sum("ar" in r.methods for r in records), 0, None, None))  # fmt: skip
    budget = max(budgets, key=lambda b: sum(_chosen(j) == b for j in group))  # the shards' most chosen
    dflash = cell(records, "dflash", ar=ar.seconds_per_token)
    ddtree = cell(records, CHOSEN, budget, ar=ar.seconds_per_token)
    measured = {budget: ddtree} if len(budgets) == 1 else {}
    sample = [r for r in records if "ar" in r.methods]
    largest = max((b for r in sample for b in [*ddtree_scopes([r]).values()]), default=None)
    if largest is not None and largest not in measured and all(f"ddtree_tb{largest}" in r.methods for r in sample):
        measured[largest] = cell(sample, f"ddtree_tb{largest}", largest)
    errors = [((j.summary or {}).get("prediction") or {}).get("error_worst") for j in group]
    error = max((float(e) for e in errors if e is not None), default=None)
    faster = ()
    if error is not None:
        bound = ddtree.speedup * (1 + error)
        faster = tuple((b, speed) for b, (_tau, speed) in sorted(curve.items()) if speed is not None and speed > bound)
    two_phase = TwoPhase(tuple(budgets), ar.measured.count(True), ar.predicted, ar.check, error, faster)
    return Entry(dataset, temperature, len(records), dflash, ddtree, curve, len(group), measured, withheld, two_phase)


def _order(dataset: str) -> int:
    return DATASETS.index(dataset) if dataset in DATASETS else len(DATASETS)


def _figure(c: Cell | None) -> str:
    """`×3.23 (2.94–3.50) · τ 4.50 (4.23–4.77)`, each figure unbreakable: MLflow's description column is narrow
    and wraps such a cell over three or four lines, and so it wraps between figures, never inside one."""
    if c is None:
        return ""
    speedup = f"×{c.speedup:.2f}" + (f" ({c.speedup_ci.low:.2f}–{c.speedup_ci.high:.2f})" if c.speedup_ci else "")
    tau = f"τ {c.tau:.2f}" + (f" ({c.tau_ci.low:.2f}–{c.tau_ci.high:.2f})" if c.tau_ci else "")
    return f"{unbreakable(speedup)}{NBSP}· {unbreakable(tau)}"  # a line may end after a dot, never start with one


def _paper(figure: PaperFigure | None) -> str:
    """The paper's figure after ours, in italics: told apart at a glance."""
    if figure is None:
        return ""
    return f"{NBSP}· _{unbreakable(f'paper ×{figure.speedup:.2f}')}{NBSP}· {unbreakable(f'τ {figure.tau:.2f}')}_"


def _failed(reason: str) -> str:
    return f"FAILED: {reason[:160]}"


def _datasets(found: Sequence[Entry], missing: Sequence[Missing]) -> list[str]:
    """Every dataset the sweep ran or tried, in the paper's order."""
    named = {e.dataset for e in found} | {m.dataset for m in missing}
    return sorted(named, key=_order)


def _methods(found: Sequence[Entry]) -> tuple[str, ...]:
    """The table's methods (`Entry` attributes): DFlash and DDTree, and DDTree-online where a job decoded it."""
    return ("dflash", "ddtree", "online") if any(e.online for e in found) else ("dflash", "ddtree")


def _versus_best(c: Cell) -> str:
    """`vs best ×0.97 (0.93–1.01)`: DDTree-online's speed over DDTree's best budget's on the same records."""
    interval = f" ({c.speedup_ci.low:.2f}–{c.speedup_ci.high:.2f})" if c.speedup_ci else ""
    return unbreakable(f"vs best ×{c.speedup:.2f}{interval}")


def _means(
    found: Sequence[Entry], temperatures: Sequence[float], methods: Sequence[str] = ("dflash", "ddtree")
) -> list[tuple[int, float, float] | None]:
    """Per (temperature, method): (how many datasets, mean speedup, mean tau), or None where none has a cell."""
    means = []
    for t in temperatures:
        for method in methods:
            chosen = [getattr(e, method) for e in found if e.temperature == t and getattr(e, method)]
            means.append(
                (len(chosen), statistics.fmean(c.speedup for c in chosen), statistics.fmean(c.tau for c in chosen))
                if chosen else None
            )  # fmt: skip
    return means


def _sets_counted(means: Sequence[tuple[int, float, float] | None], noun: str) -> str:
    """`10 datasets`; `9/10 datasets` where the mean's columns cover different numbers of them."""
    counts = sorted({m[0] for m in means if m is not None}, reverse=True)
    return f"{'/'.join(map(str, counts)) or '0'} {noun}{'' if counts == [1] else 's'}"


def markdown(found: Sequence[Entry], model: str, missing: Sequence[Missing] = ()) -> str:
    """The table as the sweep's page shows it, then the budget curve, then how to read them. A dataset whose
    jobs failed keeps its row, with the reason; the mean row says over how many datasets it is."""
    paper_model = PAPER_MODELS.get(model)
    paper = paper_figures() if paper_model else {}
    temperatures = sorted({e.temperature for e in found} | {m.temperature for m in missing})
    by_key = {(e.dataset, e.temperature): e for e in found}
    failed = {(m.dataset, m.temperature): m.reason for m in missing}
    budget = "best budget" if all(e.two_phase is None for e in found) else "budget"  # chosen, for two phases
    methods = _methods(found)
    names = {"dflash": "DFlash", "ddtree": "DDTree", "online": "DDTree-online"}
    head = ["dataset", *(f"T={t:g} {names[m]}" for t in temperatures for m in methods), budget]
    rows = []
    for dataset in _datasets(found, missing):
        cells, budgets = [], []
        for t in temperatures:
            entry = by_key.get((dataset, t))
            for method in methods:
                c = getattr(entry, method) if entry else None
                if c is None and (dataset, t) in failed:
                    cells.append(_failed(failed[(dataset, t)]) if method == "dflash" else "")
                    continue
                text = _figure(c) + (_paper(paper.get((paper_model, dataset, t, method))) if c else "")
                if method == "online" and entry and entry.online_vs_best:
                    text += f"{NBSP}· {_versus_best(entry.online_vs_best)}"
                cells.append(text)
            budgets.append(str(entry.ddtree.budget) if entry and entry.ddtree else "–")
        rows.append([dataset, *cells, " / ".join(budgets)])
    means = _means(found, temperatures, methods)
    rows.append(
        [
            f"**mean of {_sets_counted(means, 'dataset')}**",
            *(f"×{m[1]:.2f} · τ {m[2]:.2f}" if m else "" for m in means),
            "",
        ]
    )
    lines = [f"### The paper's table: {model}", "", *markdown_table(head, rows)]
    if two_phase := _two_phase_lines(found):
        lines += ["", *two_phase]
    lines += ["", *_curve_lines(found), "", *_reading(found, paper_model)]
    return "\n".join(lines) + "\n"


def _two_phase_lines(found: Sequence[Entry]) -> list[str]:
    """For the entries decoded in two phases: the budget chosen, where AR was measured and predicted and the
    prediction's error on the sample; a budget the curve predicts faster than the chosen one measured, by more
    than the prediction's error, is flagged."""
    two = [e for e in found if e.two_phase is not None]
    if not two:
        return []
    rows, flags = [], []
    for e in two:
        t = e.two_phase
        assert t is not None
        total = 0.0 if t.check is None or abs(t.check.total) < 0.0005 else t.check.total  # never "-0.0 %"
        error = "–" if t.check is None else f"{100 * t.check.median:.1f} % · {100 * total:+.1f} %"
        rows.append([e.dataset, f"{e.temperature:g}", "/".join(map(str, t.chosen)), str(t.sample_records),
                     str(t.predicted), error])  # fmt: skip
        if e.ddtree is not None and t.prediction_error is not None and t.faster:
            faster = ", ".join(f"{budget} at ×{speed:.2f}" for budget, speed in t.faster)
            flags.append(
                f"⚠ {e.dataset} T={e.temperature:g}: the curve predicts {faster}, faster than the chosen "
                f"{e.ddtree.budget} measured (×{e.ddtree.speedup:.2f}) by more than the prediction's error "
                f"(±{100 * t.prediction_error:.0f} %): the prediction that chose it missed"
            )
    head = ["dataset", "T", "budget chosen", "AR decoded", "AR predicted", "AR's error (median · total)"]
    lines = [
        "**Two phases** (docs/paper.md): DDTree's cell is the budget each job's sample predicted fastest, chosen "
        "before it was measured, decoded on every record; AR was decoded on the sample and its time per token "
        "predicted on the other records from its step cost against context length. Its error is measured on the "
        "sample, each record predicted by the fit of the others: the median per record, and on the sample's total "
        "time (what a speedup divides by).",
        "",
        *markdown_table(head, rows),
    ]
    return lines + (["", *flags] if flags else [])


def terminal_lines(found: Sequence[Entry], model: str, missing: Sequence[Missing] = ()) -> list[str]:
    """The table at 80 columns for the terminal at the sweep's end: speedup and τ per dataset, temperature
    and method (DDTree at its best budget), the budgets, the mean row; a failed dataset says so."""
    temperatures = sorted({e.temperature for e in found} | {m.temperature for m in missing})
    by_key = {(e.dataset, e.temperature): e for e in found}
    failed = {(m.dataset, m.temperature) for m in missing}

    def short(c: Cell | None, key: tuple[str, float]) -> str:
        if c is None:
            return "FAILED" if key in failed else "–"
        return f"×{c.speedup:.2f} τ{c.tau:.2f}"

    rows = []
    for dataset in _datasets(found, missing):
        cells, budgets = [], []
        for t in temperatures:
            entry = by_key.get((dataset, t))
            cells += [short(getattr(entry, m) if entry else None, (dataset, t)) for m in ("dflash", "ddtree")]
            budgets.append(str(entry.ddtree.budget) if entry and entry.ddtree else "–")
        rows.append([dataset, *cells, "/".join(budgets)])
    means = _means(found, temperatures)
    rows.append(
        [
            f"mean ({_sets_counted(means, 'set')})",
            *(f"×{m[1]:.2f} τ{m[2]:.2f}" if m else "–" for m in means),
            "",
        ]
    )
    head = ["dataset", *(["DFlash", "DDTree"] * len(temperatures)), "budget"]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    # one space inside a temperature's pair and before the budgets, two between temperatures: the widest figures
    # (×10.00 τ16.00, `livecodebench`, 1024/1024) make exactly 80 columns
    gaps = ["", " ", *(([" ", "  "] * len(temperatures))[:-1]), " "]

    def line(cells: Sequence[str]) -> str:
        aligned = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "".join(gap + c for gap, c in zip(gaps, aligned, strict=True)).rstrip()

    pair = [widths[1 + 2 * i] + 1 + widths[2 + 2 * i] for i in range(len(temperatures))]
    over = " " * (widths[0] + 1) + "  ".join(f"T={t:g}".center(w) for t, w in zip(temperatures, pair, strict=True))
    which = "its best budget" if all(e.two_phase is None for e in found) else "its chosen budget"
    text = [f"The paper's table: {model} (speedup vs AR, τ; DDTree at {which})", over.rstrip()]
    text += [line(row) for row in [head, *rows]]
    return text + online_lines(found)


def online_lines(found: Sequence[Entry]) -> list[str]:
    """Per temperature, DDTree-online over DDTree at its best budget, in a line of under 80 columns: the mean
    ratio and in how many sets it was ahead or behind beyond the 95 % interval (the terminal's table has no
    room for a column): `DDTree-online T=0: ×0.97 of the best budget (10 sets: 0 ahead, 3 behind)`."""
    lines = []
    for t in sorted({e.temperature for e in found if e.online_vs_best}):
        ratios = [e.online_vs_best for e in found if e.temperature == t and e.online_vs_best]
        ahead = sum(1 for c in ratios if c.speedup_ci and c.speedup_ci.low > 1)
        behind = sum(1 for c in ratios if c.speedup_ci and c.speedup_ci.high < 1)
        mean = statistics.fmean(c.speedup for c in ratios)
        lines.append(f"DDTree-online T={t:g}: ×{mean:.2f} of the best budget ({counted(len(ratios), 'set')}: "
                     f"{ahead} ahead, {behind} behind)")  # fmt: skip
    return lines


def _curve_lines(found: Sequence[Entry]) -> list[str]:
    """Tau and predicted speedup at every budget from the largest budget's trees; at a budget that was decoded,
    its measured tau beside the curve's, flagged where they differ by more than the measurement's interval."""
    budgets = sorted({b for e in found for b in e.curve})
    withheld = sorted({why for e in found for why in e.curve_withheld})
    if withheld:
        reasons = "; ".join(withheld)
        return [f"**Every budget**: not shown for the jobs whose {reasons}: no round could hold a whole tree, "
                "so the curve would understate every budget. Decode more tokens for it."]  # fmt: skip
    if not budgets:
        return []
    rows, flagged = [], 0
    for e in found:
        cells = []
        for b in budgets:
            tau, speed = e.curve.get(b, (None, None))
            text = "" if tau is None else f"τ {tau:.2f}" + (f" ×{speed:.2f}" if speed is not None else "")
            decoded = e.measured.get(b)
            if tau is not None and decoded is not None:
                low, high = (decoded.tau_ci.low, decoded.tau_ci.high) if decoded.tau_ci else (decoded.tau,) * 2
                off = not low - 0.005 <= tau <= high + 0.005  # beyond the interval (none under 5: beyond rounding)
                flagged += off
                text += f" (decoded τ {decoded.tau:.2f}{' ⚠' if off else ''})"
            cells.append(text)
        rows.append([e.dataset, f"{e.temperature:g}", *cells])
    lines = [
        "**Every budget** (tau from the largest decoded budget's trees; speedup predicted from the run's costs; "
        "at a decoded budget, the tau it measured):",
        "",
        *markdown_table(["dataset", "T", *(str(b) for b in budgets)], rows),
    ]
    if flagged:
        lines += [
            "",
            f"⚠ {flagged} decoded budget{'s' * (flagged > 1)} measured a tau outside the curve's figure by more than "
            "its 95 % interval: the curve's tau at that budget is not borne out on these records.",
        ]
    return lines


def _reading(found: Sequence[Entry], paper_model: str | None) -> list[str]:
    records = sum(e.records for e in found)
    grid = any(e.two_phase is None for e in found)
    budget = (
        "DDTree at its fastest decoded budget" if grid and len(found) and all(e.two_phase is None for e in found)
        else "DDTree at the budget chosen before it was measured (two phases) or at its fastest decoded budget"
        if grid else "DDTree at the budget chosen before it was measured (two phases)"
    )  # fmt: skip
    lines = [
        f"Figures the paper's way over {records} records: speedup = mean of AR's time per output token ÷ mean of the "
        f"method's (decode time, prefill excluded); τ = mean of each record's tokens per round; {budget}. 95 % "
        "intervals over records (none under 5 records). A final round cut by the token limit counts the tokens it "
        "kept (the paper's counts its whole acceptance)."
    ]
    if any(e.online for e in found):
        lines.append(
            "DDTree-online: DDTree with a budget per round, chosen from the drafter's calibrated confidence and the "
            "run's measured costs (docs/decoding.md); `vs best` is its speed over DDTree's best budget's on the same "
            "records (that budget picked after the fact, which favours it), with its 95 % interval."
        )
    if paper_model:
        lines.append(
            f"`paper` is the DDTree paper's own figure for {paper_model} (github.com/liranringel/ddtree "
            "src/data/results.tex): same datasets, prompts and settings, on the authors' GPUs."
        )
    return lines


def write_csv(found: Sequence[Entry], model: str, path: Path) -> None:
    """One row per (dataset, temperature, method), the paper's figure beside ours where it reports the model."""
    paper_model = PAPER_MODELS.get(model)
    paper = paper_figures() if paper_model else {}
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for e in found:
            for method, c in (("dflash", e.dflash), ("ddtree", e.ddtree), (ONLINE, e.online)):
                if c is None:
                    continue
                ours = paper.get((paper_model, e.dataset, e.temperature, method)) if paper_model else None
                writer.writerow([
                    e.dataset, f"{e.temperature:g}", method, c.budget or "", c.records, f"{c.speedup:.4f}",
                    _bound(c.speedup_ci, "low"), _bound(c.speedup_ci, "high"), f"{c.tau:.4f}",
                    _bound(c.tau_ci, "low"), _bound(c.tau_ci, "high"),
                    "" if ours is None else ours.speedup, "" if ours is None else ours.tau,
                ])  # fmt: skip


def _bound(interval: Interval | None, side: str) -> str:
    return "" if interval is None else f"{getattr(interval, side):.4f}"


def load_job(
    generations: Path, summary: Path | None, dataset: str, temperature: float, model: str, max_new_tokens: int = 0
) -> JobRecords:
    """A job's records and budget curve from its downloaded files. A decode shorter than one draft block
    (`max_new_tokens`, from the job's params) cannot hold a whole tree in any round: its curve is left out,
    and the table says why (a curve of such rounds once said τ 1.00 where the decode measured 4.00)."""
    with generations.open(encoding="utf-8") as f:
        records = read_records(f)
    document = json.loads(summary.read_text(encoding="utf-8")) if summary is not None and summary.is_file() else None
    block = int((document or {}).get("block_size") or 0)
    if document is not None and 0 < max_new_tokens < block and document.get("budget_curve"):
        why = f"decode.max_new_tokens={max_new_tokens} is shorter than a draft block ({block})"
        document = {**document, "budget_curve": None, "curve_withheld": why}
    return JobRecords(dataset, temperature, model, records, document)
