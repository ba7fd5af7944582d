"""A sweep's plan before it starts, and its estimate of the GPU-time left as its jobs end.

Before the first job: how many jobs, records (a prompt's turns each), methods and decodes the grid holds, read
from the grid itself (the basic sweeper's job list) and the prompt sets it names (each read once; a set that
cannot be read here leaves its jobs' records unknown, never guessed). The per-job counts go into `sweep.json`.

As each job ends: the GPU-time the sweep's jobs have taken so far (each job holds one GPU lease from its
run's start to its end) over the records they decoded gives the time per record, and the records of the jobs
not yet ended give the estimate: `plan: 3/20 jobs done in 14.2 GPU-min · about 80.0 GPU-min left (2.3 s a record)`.
A job reused from an earlier sweep took no time here and counts as done; a failed one counts apart and its
time, spent on no record, is left out of the time per record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlflow.tracking import MlflowClient

from orchestrator.config.prompts import resolve_prompts
from orchestrator.config.validation import ConfigError
from orchestrator.sweep.resume import reused_jobs
from orchestrator.tracking.tags import SWEEP_JOB
from remote_worker.decoding.two_phase import sample_positions
from remote_worker.prompt_set import PromptSetError
from remote_worker.wording import counted


@dataclass(frozen=True)
class Plan:
    records: list[int | None]  # per job, in job order; None where its prompt set cannot be read here
    job_decodes: list[int | None]  # per job: its decodes (a method over a record, each pass), None where unknown

    @property
    def decodes(self) -> int | None:
        if any(d is None for d in self.job_decodes):
            return None
        return sum(d or 0 for d in self.job_decodes)

    def line(self) -> str:
        jobs = counted(len(self.records), "job")
        if self.decodes is None:
            return f"plan: {jobs} · records not known here (a job's prompts are chosen on the host, or unreadable here)"
        records = sum(r or 0 for r in self.records)
        return (
            f"plan: {jobs} · {counted(records, 'record')} · {counted(self.decodes, 'decode')} (a method over a record)"
        )


def _turns(experiment: Mapping[str, Any]) -> list[int] | None:
    """A job's prompts (after num_prompts and its shard), each as its turns (a record each); None where its
    prompt set cannot be read here."""
    try:
        prompts = resolve_prompts(experiment.get("prompts"), experiment.get("datasets_dir"))
    except (PromptSetError, ConfigError, OSError):
        return None
    if prompts is None:
        return None
    limit = experiment.get("num_prompts")
    prompts = prompts[: int(limit)] if limit else prompts
    shard = experiment.get("shard")
    if shard is not None:
        part, _, count = str(shard).partition("/")
        prompts = prompts[int(part) :: int(count)]
    return [p.turns for p in prompts]


def job_decodes(turns: list[int], decode: Mapping[str, Any]) -> int:
    """A job's decodes. The grid protocol: every record by AR, DFlash and each budget. Two phases
    (`decoding.two_phase`): the sample's records by AR, DFlash and the largest budget, then every record by
    DFlash and the chosen budget, which the sample's records decode alone (at most: none where the chosen budget
    is the largest)."""
    records, repeats = sum(turns), int(decode.get("repeats") or 1)
    if str(decode.get("protocol") or "grid") == "two_phase":
        sample = sum(turns[p] for p in sample_positions(len(turns), int(decode.get("sample_every") or 8)))
        return (2 * records + 2 * sample) * repeats
    budgets = decode.get("tree_budgets") or []
    count = len(budgets) if isinstance(budgets, list | tuple) else len(str(budgets).strip("[]").split(","))
    return records * (2 + count) * repeats


def make_plan(base: Mapping[str, Any], jobs: Sequence[Mapping[str, str]]) -> Plan:
    """The plan of `jobs` (each the overrides that make it, key → value) over the `base` config."""
    records: list[int | None] = []
    decodes: list[int | None] = []
    cache: dict[tuple, list[int] | None] = {}
    for job in jobs:
        experiment = dict(base.get("experiment") or {})
        decode = dict(base.get("decode") or {})
        for key, value in job.items():
            section, _, name = key.partition(".")
            if section == "experiment":
                experiment[name] = None if value == "null" else value
            elif section == "decode":
                decode[name] = value
        key = tuple(str(experiment.get(k)) for k in ("prompts", "datasets_dir", "num_prompts", "shard"))
        if key not in cache:
            cache[key] = _turns(experiment)
        turns = cache[key]
        records.append(sum(turns) if turns is not None else None)
        decodes.append(job_decodes(turns, decode) if turns is not None else None)
    return Plan(records, decodes)


def progress_line(
    client: MlflowClient, parent_run_id: str, records: Sequence[int | None], noted: Mapping[int, str]
) -> str:
    """The sweep so far, from its job runs' own start and end times, and the GPU-time left at that pace.

    Finished, failed (or killed) and reused jobs are counted apart: a failed job took GPU time but decoded
    nothing, so the time per record is the finished jobs' time over their records alone. A reused job counts
    only where the parent's `sweep.reused.<job>` tag names the run the job itself noted taking (`noted`, from
    `Sweep.reused_here`: each was checked as resume checks, once); a tag anyone else wrote is counted as
    refused, neither done nor reused. (The page checks every named run again, signature and all, once.)"""
    parent = client.get_run(parent_run_id)
    named = reused_jobs(parent)
    reused = {n for n, run_id in named.items() if noted.get(n) == run_id}
    refused = len(named) - len(reused)
    runs = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=10000
    )
    ended = [(n, r) for r in runs if r.info.end_time and (n := _job(r.data.tags.get(SWEEP_JOB))) is not None]
    finished = {n for n, r in ended if r.info.status == "FINISHED"}
    failed = {n for n, _ in ended} - finished - reused
    seconds = sum((r.info.end_time - r.info.start_time) / 1000 for _, r in ended)
    parts = [f"plan: {len(finished | reused)}/{len(records)} jobs done"]
    parts += [f"{len(reused)} reused"] * bool(reused) + [f"{len(failed)} failed"] * bool(failed)
    parts += [f"{refused} reused run{'s' * (refused > 1)} refused"] * bool(refused)
    line = f"{parts[0]} ({', '.join(parts[1:])})" if len(parts) > 1 else parts[0]
    line += f" in {gpu_time(seconds)}"
    decoded = sum(records[n] or 0 for n in finished - reused if n < len(records))
    if not decoded or any(r is None for r in records):
        return line
    taken = sum((r.info.end_time - r.info.start_time) / 1000 for n, r in ended if n in finished - reused)
    per_record = taken / decoded
    left = sum(r or 0 for n, r in enumerate(records) if n not in finished | reused | failed)
    if not left:  # the last job: what it all took, no estimate of nothing
        return line + f" ({per_record:.1f} s a record)"
    return line + f" · about {gpu_time(left * per_record)} left ({per_record:.1f} s a record)"


def gpu_time(seconds: float) -> str:
    """`42 GPU-s`, `14.2 GPU-min`, `31.5 GPU-h`: what a lease held, in the unit that reads."""
    if seconds < 120:
        return f"{seconds:.0f} GPU-s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} GPU-min"
    return f"{seconds / 3600:.1f} GPU-h"


def _job(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None
