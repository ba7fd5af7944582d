"""A sweep's results read back from MLflow: one row per (job, method), whichever launcher ran the jobs."""

from __future__ import annotations

from dataclasses import dataclass

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from orchestrator.config import host_values
from orchestrator.config.text import printable
from orchestrator.sweep.resume import checked_reused
from orchestrator.tracking import tags as mlflow_tags

# A method run's figures a row carries; the 95 % intervals over prompts and DDTree's speedup over DFlash are
# None where the run has none (one prompt, AR, a run from before they were logged).
INTERVALS = ("tau_ci_low", "tau_ci_high", "speedup_vs_ar_ci_low", "speedup_vs_ar_ci_high", "speedup_vs_dflash",
             "speedup_vs_dflash_ci_low", "speedup_vs_dflash_ci_high")  # fmt: skip
METRICS = ("tau", "speedup_vs_ar", "tokens_per_s", "lossless", *INTERVALS)
REFUSED = "REFUSED"  # a row a sweep's parent names as reused that fails the checks: shown, never the sweep's status


@dataclass(frozen=True)
class Row:
    job: int
    status: str
    model: str
    overrides: str
    varies: str = ""  # the overrides that differ between the jobs of the sweep
    method: str = ""  # the method run's scope: ar, dflash, ddtree_tb32
    kind: str = ""  # ar, dflash or ddtree
    tree_budget: int | None = None
    tau: float | None = None
    speedup_vs_ar: float | None = None
    tokens_per_s: float | None = None
    lossless: float | None = None
    tau_ci_low: float | None = None
    tau_ci_high: float | None = None
    speedup_vs_ar_ci_low: float | None = None
    speedup_vs_ar_ci_high: float | None = None
    speedup_vs_dflash: float | None = None
    speedup_vs_dflash_ci_low: float | None = None
    speedup_vs_dflash_ci_high: float | None = None
    repeats: int | None = None  # decode passes per prompt behind the figures (their medians)
    error: str = ""
    run_id: str = ""  # the job's run
    reused: bool = False  # taken from an earlier sweep's run with the same settings (`sweep.resume`)

    def settings(self) -> dict[str, str]:
        """The varying overrides as key → value: `{"decode.block_size": "8"}`."""
        return override_pairs(self.varies)

    def given(self) -> dict[str, str]:
        """Every override of the job as key → value."""
        return override_pairs(self.overrides)


def override_pairs(overrides: str) -> dict[str, str]:
    """`a.b=1 c=2` → {"a.b": "1", "c": "2"}: the overrides tag split at spaces, as `sweep_rows` reads it."""
    return dict(o.partition("=")[::2] for o in overrides.split())


def varying_keys(rows: list[Row]) -> list[str]:
    """The keys the sweep's jobs differ in, in the order the overrides give them."""
    return list(dict.fromkeys(key for row in rows for key in row.settings()))


def short_names(keys: list[str]) -> dict[str, str]:
    """`decode.block_size` → `block_size`: each key's last part, the whole key where two would read alike."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: short if last.count(short) == 1 else key for key, short in zip(keys, last, strict=True)}


def _children(client: MlflowClient, experiment_ids: list[str], parent: str) -> list[Run]:
    return client.search_runs(experiment_ids, f"tags.mlflow.parentRunId = '{parent}'", max_results=10000)


def sweep_rows(client: MlflowClient, parent_run_id: str, key: bytes | None = None) -> list[Row]:
    """One row per (job, method); a job without method runs (a probe, a failure) is one row. A job the sweep
    took from an earlier run (`sweep.resume`) is read from that run, under this sweep's job number, when that
    run passes the checks resume applies (`resume.why_not`, its signature under `key`): a `sweep.reused.<job>`
    tag is a claim anyone may write on the parent. One that fails is a REFUSED row saying why, which leaves
    the sweep's status as its own jobs make it."""
    experiment_ids = [e.experiment_id for e in client.search_experiments()]
    jobs = [(_job_number(run.data.tags), run, "") for run in _children(client, experiment_ids, parent_run_id)]
    named = checked_reused(client, client.get_run(parent_run_id), key)
    gone = [
        Row(job=number, status=REFUSED, model="", overrides="", error=printable(why)[:300])
        for number, why in named.refused.items()
    ]
    jobs += [(number, earlier, earlier.info.run_id) for number, earlier in named.accepted.items()]
    jobs.sort(key=lambda job: job[0])
    overrides = {run.info.run_id: run.data.tags.get(mlflow_tags.HYDRA_OVERRIDES, "").split() for _, run, _ in jobs}
    common = set.intersection(*(set(o) for o in overrides.values())) if len(jobs) > 1 else set()
    rows = []
    for number, job, reused in jobs:
        tags = job.data.tags
        base = {
            "job": number,
            "status": job.info.status,
            "model": printable(tags.get(mlflow_tags.MODEL, ""))[:80],
            "overrides": " ".join(overrides[job.info.run_id]),
            "varies": " ".join(o for o in overrides[job.info.run_id] if o not in common),
            "error": printable(tags.get(mlflow_tags.ERROR, "").splitlines()[0])[:300]
            if tags.get(mlflow_tags.ERROR)
            else "",
            "run_id": job.info.run_id,
            "reused": bool(reused),
        }
        methods = _children(client, experiment_ids, job.info.run_id)
        if not methods:
            rows.append(Row(**base))
        for method in sorted(methods, key=_method_order):
            kind = method.data.params.get("method", "")
            budget = method.data.params.get("tree_budget") if kind == "ddtree" else None  # AR and DFlash log 0
            values = {k: method.data.metrics.get(k) for k in METRICS}
            rows.append(
                Row(
                    **base,
                    method=printable(method.data.tags.get(mlflow_tags.SCOPE, method.info.run_name or ""))[:80],
                    kind=kind,
                    repeats=_count(method.data.params.get("repeats")),
                    tree_budget=_count(budget),
                    **values,
                )
            )
    return sorted(rows + gone, key=lambda row: row.job)


def _method_order(run: Run) -> tuple[int, int]:
    kind = {"ar": 0, "dflash": 1}.get(run.data.params.get("method", ""), 2)
    return kind, _count(run.data.params.get("tree_budget")) or 0


def _count(text: str | None) -> int | None:
    """A whole number a param or tag holds; None where it holds none (absent, `None`, or not a number)."""
    try:
        return host_values.integer(str(text), 0)
    except ValueError:
        return None


def _job_number(run_tags: dict[str, str]) -> int:
    """The job's number in its sweep (its `sweep.job` tag); -1 where that is not a number."""
    number = _count(run_tags.get(mlflow_tags.SWEEP_JOB))
    return -1 if number is None else number
