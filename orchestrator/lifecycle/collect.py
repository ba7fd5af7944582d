"""The end of a job: every event still waiting applied, the run's files logged, its page written, its run ended."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from orchestrator.config.redaction import redact_text
from orchestrator.host.run_folder import SPEC_FILE, STDERR_FILE
from orchestrator.host.transport import (
    CONNECTION_ERRORS,
)
from orchestrator.lifecycle.follow import Reconnect
from orchestrator.lifecycle.job import GENERATIONS_FILE, GENERATIONS_TABLE, STDERR_TAIL_LINES, Job, fetch
from orchestrator.stream.events import EVENTS_FILE
from orchestrator.tracking import tags
from orchestrator.tracking.client import TrackingUnavailable, outages_named, short_reason
from orchestrator.tracking.job_summary import generation_rows, method_note, prompt_dataset, summarize
from orchestrator.tracking.plots import SUMMARY_FILE, plot_decode_summary
from orchestrator.tracking.runs import end_run
from orchestrator.tracking.signing import sign_run, signing_key
from orchestrator.tracking.status import Outcome, RunStatus
from remote_worker.prompt_set import RUN_PROMPTS_FILE
from remote_worker.wording import counted


def collect(job: Job, outcome: Outcome) -> None:
    """Apply every event still waiting (waiting for MLflow if it must), then log the run's files.

    The events decide the run; the files are extras: one that cannot be fetched or logged (other than
    because MLflow is out of reach) is a warning, never a different status."""
    if job.launched or job.mirror.size:
        apply_all(job)
    if not job.launched:
        return
    try:
        with outages_named():
            job.sink.send_recent_log(now=True)
    except TrackingUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - an extra: events.jsonl holds every line anyway
        job.live.note(f"[yellow]worker_log.txt not logged: {type(exc).__name__}: {short_reason(exc)}[/yellow]")
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / EVENTS_FILE
        job.mirror.copy_to(events)
        _log_file(job, events)
        for name in (STDERR_FILE, RUN_PROMPTS_FILE):
            local = Path(tmp) / name
            if fetch(job, name, local):
                _log_file(job, local)
                if name == RUN_PROMPTS_FILE:
                    _log_prompt_set(job, local)
                if name == STDERR_FILE:
                    text = local.read_text(encoding="utf-8", errors="replace")
                    job.stderr_tail = text.splitlines()[-STDERR_TAIL_LINES:]
        summary = Path(tmp) / SUMMARY_FILE
        if outcome.status is RunStatus.FINISHED and fetch(job, SUMMARY_FILE, summary):
            try:
                figures = plot_decode_summary(summary, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - a summary the plots cannot read is the worker's to fix
                job.live.note(f"[yellow]no plots: {SUMMARY_FILE} could not be read ({type(exc).__name__}: {exc})[/]")
                figures = []
            for figure in figures:
                _log_file(job, figure, "plots")
            try:
                _describe(job, summary, Path(tmp))
            except TrackingUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - the description is an extra; the metrics are in
                job.live.note(f"[yellow]no description: {type(exc).__name__}: {short_reason(exc)}[/yellow]")
    if outcome.status is RunStatus.FINISHED:
        _sign(job)


def _sign(job: Job) -> None:
    """The finished run's signature (`tracking/signing.py`): a sweep run again reuses only runs that carry it."""
    try:
        key = signing_key(Path(job.config.orchestrator.state_dir))
        with outages_named():
            sign_run(job.client, job.state.run_id, key)
    except TrackingUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - unsigned costs a decode again on resume, never a figure
        job.live.note(f"[yellow]run not signed (a sweep run again decodes it again): {short_reason(exc)}[/yellow]")


def _describe(job: Job, summary: Path, tmp: Path) -> None:
    """The job's page answers the comparison: the table as its description and as files, the generations
    as an MLflow table (one row per prompt and method)."""
    document = json.loads(summary.read_text(encoding="utf-8"))  # the run's own settings, also on attach
    temperature = float(document.get("temperature") or 0)
    block = f" · block {document['block_size']}" if document.get("block_size") else ""
    title = f"{document.get('model')} · {document.get('dtype')} · T={temperature:g}{block} · {job.host_label}"
    rendered = summarize(document, title)
    with outages_named():
        job.client.set_tag(job.state.run_id, tags.NOTE, rendered.markdown)
        for method in document.get("methods") or []:  # every run has a description, each method's too
            child = job.state.children.get(str(method.get("scope")))
            if child is not None:
                job.client.set_tag(child, tags.NOTE, method_note(method, title))
    files = [("summary.md", rendered.markdown), ("summary.csv", rendered.csv)]
    if rendered.budget_csv is not None:
        files.append(("budget_curve.csv", rendered.budget_csv))
    for name, text in files:
        (tmp / name).write_text(text, encoding="utf-8")
        _log_file(job, tmp / name)
    generations = tmp / GENERATIONS_FILE
    with outages_named():
        logged = {a.path for a in job.client.list_artifacts(job.state.run_id)}
    if GENERATIONS_TABLE not in logged and fetch(job, GENERATIONS_FILE, generations):  # log_table appends
        try:
            with outages_named():
                job.client.log_table(job.state.run_id, generation_rows(generations), GENERATIONS_TABLE)
        except TrackingUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - the table is an extra; generations.jsonl is logged anyway
            job.live.note(f"[yellow]generations table not logged: {type(exc).__name__}: {short_reason(exc)}[/]")


def _log_prompt_set(job: Job, path: Path) -> None:
    spec = Path(path).with_name(SPEC_FILE)  # the run's own choice (on attach, the command's config may differ)
    name = "prompts"
    if fetch(job, SPEC_FILE, spec):
        name = str(json.loads(spec.read_text(encoding="utf-8")).get("experiment", {}).get("prompts") or name)
    try:
        with outages_named():
            job.client.log_inputs(job.state.run_id, datasets=[prompt_dataset(path, name)])
    except TrackingUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - an extra: the prompt file itself is logged already
        job.live.note(f"[yellow]prompt set not logged as a dataset: {type(exc).__name__}: {short_reason(exc)}[/]")


def _log_file(job: Job, path: Path, folder: str | None = None) -> None:
    try:
        with outages_named():
            job.client.log_artifact(job.state.run_id, str(path), artifact_path=folder)
    except TrackingUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - refused by the store (too large, a proxy's limit): say so
        job.live.note(f"[yellow]{path.name} was not logged: {type(exc).__name__}: {short_reason(exc)}[/yellow]")


def finish(job: Job, outcome: Outcome) -> None:
    if outcome.status is not RunStatus.FINISHED:
        _describe_unfinished(job, outcome)
    with outages_named():
        if job.config.command.value == "attach":
            job.client.set_tag(job.state.run_id, tags.DETACHED, "false")  # followed to its end after all
        end_run(job.client, job.sink.run_ids(), outcome, error_already_tagged=job.sink.error is not None)
    job.mirror.remove()  # MLflow holds it now (events.jsonl); only the stream state stays


def _decodes_done(job: Job) -> tuple[int, int] | None:
    """How many of the run's decodes (prompt × method × pass) ran before the end: its last `decode` progress."""
    events, _ = job.mirror.events_after(0)
    for event in reversed(events):
        data = event.data if isinstance(event.data, dict) else {}
        if event.kind == "progress" and data.get("task") == "decode":
            done, total = data.get("completed"), data.get("total")
            if isinstance(done, int) and isinstance(total, int) and total > 0:
                return done, total
    return None


def _describe_unfinished(job: Job, outcome: Outcome) -> None:
    """A run that did not finish says so on its page, how many of its decodes ran before the end, and which
    methods reported figures (a method's figures come once every prompt is decoded); a method run whose figures
    never came says so (rather than an empty page, KILLED like the rest). An extra: what MLflow cannot take now
    is left out."""
    status, why = outcome.status.value, redact_text(outcome.error or "")
    try:
        with outages_named():
            reached, missed = [], []
            for scope, run_id in job.state.children.items():
                (reached if job.client.get_run(run_id).data.metrics else missed).append(scope)
            done = _decodes_done(job)
            ran = f" after {done[0]} of {counted(done[1], 'decode')}" if done else ""
            for scope in missed:
                note = (f"**Not finished**: the run ended {status}{ran}, before {scope}'s figures were reported "
                        f"(they come once every prompt is decoded) ({why}).")  # fmt: skip
                job.client.set_tag(job.state.children[scope], tags.NOTE, note)
            page = f"**{status}**: {why}" if why else f"**{status}**"
            told = [f"{done[0]} of {counted(done[1], 'decode')} ran before the end."] if done else []
            if job.state.children:
                told.append("Figures reported: " + (", ".join(reached) or "none")
                            + ("; not reported: " + ", ".join(missed)) * bool(missed) + ".")  # fmt: skip
            if told:
                page += "\n\n" + " ".join(told)
            if tags.NOTE not in job.client.get_run(job.state.run_id).data.tags:
                job.client.set_tag(job.state.run_id, tags.NOTE, page)
    except Exception as exc:  # noqa: BLE001 - the end itself matters more than its description
        job.live.note(f"[yellow]no description: {type(exc).__name__}: {short_reason(exc)}[/yellow]")


def apply_all(job: Job) -> None:
    """Everything read must reach MLflow before the run ends; wait for it up to tracking.outage_wait_s
    (not at all after a Ctrl-C: the user asked to stop, and attach finishes the run exactly later)."""
    wait = 0.0 if job.interrupted else job.config.tracking.outage_wait_s
    deadline = time.monotonic() + wait
    said = False
    reconnect = Reconnect(job.transport, job.config.host.reconnect_budget_s, job.live.note)
    while True:
        try:
            if job.applier.apply(now=True):
                reconnect.succeeded()
                return
        except CONNECTION_ERRORS as error:  # fetching a listed artifact from the host
            reconnect.after(error)
            continue
        if time.monotonic() >= deadline:
            job.tracking_down = True
            raise TrackingUnavailable(
                f"still no answer after tracking.outage_wait_s={job.config.tracking.outage_wait_s:g}s"
                f" with {counted(job.applier.waiting, 'event')} waiting"
            )
        if not said:
            job.live.note(
                f"[yellow]the worker has ended; waiting up to {wait:g}s for MLflow "
                "(Ctrl-C leaves the run for attach)[/yellow]"
            )
            said = True
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
