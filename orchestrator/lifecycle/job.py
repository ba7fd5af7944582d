"""One job's lifecycle as phases: open host → preflight → sync → launch → follow → collect → finish.

Each phase is a short function that does one thing and turns the failures it expects into the error kinds
of `errors.py`; `lifecycle` is the one place that decides what each kind means for the run (stop the
worker or not, FAILED or KILLED or left for `attach`) and then always collects and finishes. The commands
in `cli/app.py` (run, detach, attach, cancel) are the same recipe with a different body.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.markup import escape

from orchestrator.config.commands import attach_command, cancel_command
from orchestrator.config.prompts import prompts_file_text
from orchestrator.config.redaction import redact_text
from orchestrator.config.settings import Command, JobConfig
from orchestrator.host.launch import forget_env, start_worker, stop_worker, wait_for_start, write_spec
from orchestrator.host.preflight import PreflightFailed, lease_candidates, run_preflight, workdir_problem
from orchestrator.host.proof import NotProven
from orchestrator.host.run_folder import SPEC_FILE, STDERR_FILE, WorkerStatus
from orchestrator.host.sync import remove_abandoned_parts
from orchestrator.host.transport import (
    CONNECTION_ERRORS,
    CommandFailed,
    ConnectFailed,
    HostKeyRefused,
    Transport,
    UnsafePath,
)
from orchestrator.lifecycle.display import LiveProgress
from orchestrator.lifecycle.errors import HostLost, Interrupted, LocalFailure, PhaseFailed
from orchestrator.lifecycle.follow import Applier, Follower, FollowSettings, Reconnect
from orchestrator.stream.events import EVENTS_FILE
from orchestrator.stream.mirror import EventMirror
from orchestrator.stream.sink import MlflowSink
from orchestrator.stream.state import StateStore, StreamState
from orchestrator.sweep import Sweep, SweepCancelled
from orchestrator.sweep.slurm import (
    STOP_GRACE_S,
    SlurmEnd,
    SlurmStopped,
    job_fields,
    time_limit_text,
    why_stopped,
)
from orchestrator.tracking import tags
from orchestrator.tracking.client import TrackingUnavailable, outages_named, short_reason
from orchestrator.tracking.job_summary import generation_rows, prompt_dataset, summarize
from orchestrator.tracking.plots import SUMMARY_FILE, plot_decode_summary
from orchestrator.tracking.runs import end_run, mark_detached
from orchestrator.tracking.status import CANCELLED_ELSEWHERE_EXIT, Outcome, RunStatus, Stage
from remote_worker.prompt_set import RUN_PROMPTS_FILE

STDERR_TAIL_LINES = 20
CANCEL_REQUEST_FILE = "cancel_requested"  # left in the run folder by `cancel` before it stops the worker
CANCELLED_BY_USER = "cancelled by the user"
GENERATIONS_FILE = "generations.jsonl"  # written by experiment=ddtree_gdn, one row per prompt
GENERATIONS_TABLE = "generations_table.json"


@dataclass
class Job:
    """Everything one job holds open, filled in phase by phase."""

    config: JobConfig
    console: Console
    live: LiveProgress
    client: MlflowClient
    store: StateStore
    transport: Transport
    experiment_id: str
    state: StreamState
    check_interrupt: Callable[[], None]
    stopping: Callable[[], None] = lambda: None  # from now on Ctrl-C must not interrupt the clean-up
    sweep: Sweep | None = None
    started_s_ago: float = 0.0  # attach: how long ago the run began (for the start deadline)
    stop_grace_s: float | None = None  # SIGTERM to SIGKILL in a stop; None: orchestrator.kill_grace_s
    launched: bool = False  # a worker may be running: every failure from here on stops it
    tracking_down: bool = False  # the last call to MLflow found it unreachable
    interrupted: bool = False  # Ctrl-C or a cancel: nothing waits any more
    found_ended: bool = False  # cancel: the worker had ended before the cancel came (its end is only recorded)
    stderr_tail: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    _mirror: EventMirror | None = None
    _sink: MlflowSink | None = None
    _applier: Applier | None = None

    @property
    def mirror(self) -> EventMirror:
        if self._mirror is None:
            self._mirror = EventMirror(self.store.files, self.store.mirror_name(self.state.run_id), self.state.run_dir)
        return self._mirror

    @property
    def sink(self) -> MlflowSink:
        if self._sink is None:
            self._sink = MlflowSink(self.client, self.experiment_id, self.state, self.store, self.transport)
        return self._sink

    @property
    def applier(self) -> Applier:
        if self._applier is None:
            self._applier = Applier(self.sink, self.mirror, self.live.note)
        return self._applier

    @property
    def host_label(self) -> str:
        return self.config.host.name


# -- phases ---------------------------------------------------------------------------------------------


def open_host(job: Job, *, leave_if_unreachable: bool = False) -> None:
    """Connect. A run that never reached its host fails at `connect`; one already running there (attach,
    cancel) is left as it is, since its worker may be fine."""
    try:
        job.transport.open()
    except (ConnectFailed, HostKeyRefused, *CONNECTION_ERRORS) as exc:
        message = f"{job.host_label}: {exc}"
        if leave_if_unreachable:
            raise HostLost(message) from exc
        raise PhaseFailed(Stage.CONNECT, message) from exc
    if job.config.host.is_ssh:
        job.live.note(f"connected to {job.host_label} ({job.config.host.address})")


def preflight(job: Job) -> dict[str, Any]:
    host = job.config.host
    try:
        report = run_preflight(job.transport, host, job.config.worker_sections["model"], _python(job))
        job.live.note(f"preflight: {_describe_host(report)}")
        return report
    except PreflightFailed as exc:
        raise PhaseFailed(Stage.PREFLIGHT, str(exc)) from exc
    except CONNECTION_ERRORS as exc:
        raise PhaseFailed(Stage.PREFLIGHT, f"{host.name}: connection lost during preflight: {exc}") from exc


def sync(job: Job) -> str:
    try:
        code_dir, copied = job.transport.prepare_code(
            job.config.host.workdir, job.config.host.sync, owner=job.state.run_id
        )
    except (CommandFailed, RuntimeError, *CONNECTION_ERRORS) as exc:
        raise PhaseFailed(Stage.SYNC, f"{job.host_label}: code sync failed: {exc}") from exc
    if job.config.host.is_ssh:
        job.live.note(f"code synced to {code_dir} ({'copied' if copied else 'cached: already on the host'})")
    return code_dir


def _describe_host(report: dict[str, Any]) -> str:
    """`python 3.12, torch 2.13, CUDA 12.8, 1× NVIDIA H200 (139 GiB free)`: what the run will use."""
    gpus = report.get("gpus") or []
    names = sorted({str(g.get("name")) for g in gpus})
    if gpus:
        free = ", ".join(f"{g.get('free_gib', 0):.0f}" for g in gpus)
        devices = f"{len(gpus)}× {' / '.join(names)} ({free} GiB free)"
    else:
        devices = "no GPU"
    return f"python {report.get('python')}, torch {report.get('torch')}, CUDA {report.get('cuda') or 'none'}, {devices}"


def launch(job: Job, report: dict[str, Any], code_dir: str) -> None:
    """Write the spec, start the worker detached, and wait (with a deadline) until it has a pid."""
    host, run_dir = job.config.host, job.state.run_dir
    try:
        prompts = prompts_file_text(job.config.worker_sections["experiment"].get("prompts"))
        spec = worker_spec(job.config, job.state.run_id, run_dir, prompts_sent=prompts is not None)
        write_spec(job.transport, run_dir, spec, prompts)
        job.launched = True
        with contextlib.suppress(TrackingUnavailable, MlflowException), outages_named():
            # The run's folder exists from now on: attach and cancel refuse to end the run where it is missing.
            job.client.set_tag(job.state.run_id, tags.HOST_RUN_DIR, run_dir)
        start_worker(
            job.transport,
            run_dir,
            _python(job),
            code_dir,
            host.env,
            lease_candidates(host, report),
            host.gpu_lock_dir,
        )
    except (CommandFailed, *CONNECTION_ERRORS) as exc:
        with contextlib.suppress(CommandFailed, *CONNECTION_ERRORS):
            forget_env(job.transport, run_dir)
        problem = _quietly(lambda: workdir_problem(job.transport, host.workdir))
        raise PhaseFailed(Stage.LAUNCH, f"{host.name}: {problem or f'could not start the worker: {exc}'}") from exc
    timeout = job.config.orchestrator.start_timeout_s
    try:
        status = wait_for_start(job.transport, run_dir, timeout, job.check_interrupt)
    except CONNECTION_ERRORS as exc:  # the worker may well be running: left for attach
        raise HostLost(f"{job.host_label}: connection lost just after the start: {exc}") from exc
    if status.state in ("starting", "unstarted"):
        stderr = _host_text(job, STDERR_FILE).strip().splitlines()
        said = stderr[-1] if stderr else "the start command printed nothing"
        with contextlib.suppress(CommandFailed, *CONNECTION_ERRORS):  # the supervisor never read it
            forget_env(job.transport, run_dir)
        if status.state == "unstarted":  # its stderr says why: no need to wait for the deadline
            raise PhaseFailed(Stage.LAUNCH, f"{host.name}: the worker did not start: {said}")
        raise PhaseFailed(
            Stage.LAUNCH,
            f"{host.name}: the worker did not start within {timeout:g}s (orchestrator.start_timeout_s): {said}",
        )
    job.live.note(f"worker started on {host.name}" + (f" (pid {status.pid})" if status.pid else ""))


# The files of one attempt of the worker: a worker started again in the same run begins without them (its
# event log and spec stay; the earlier attempt's stderr is kept beside).
_CLEAR_ATTEMPT = (
    'cd "$1" || exit 1; [ -f stderr.log ] && [ ! -L stderr.log ] && mv -fT stderr.log stderr.previous.log; '
    "rm -f pid exit_code gpu_lease waiting_for_gpu cancelled stdout.log stderr.log ./*.part.*; exit 0"
)


def relaunch(job: Job, report: dict[str, Any], code_dir: str) -> None:
    """Start the worker again in the same run (a requeued Slurm job): its event log goes on from the last
    `seq`, its new `start` begins a new attempt (`stream/mirror.py`), its metrics come from this attempt."""
    try:
        job.transport.run(["sh", "-c", _CLEAR_ATTEMPT, "clear", job.state.run_dir])
    except (CommandFailed, *CONNECTION_ERRORS) as exc:
        raise PhaseFailed(Stage.LAUNCH, f"{job.host_label}: could not start the worker again: {exc}") from exc
    job.mirror.end = None
    job.live.note("starting the worker again in the same run")
    launch(job, report, code_dir)


def ended_on_its_own(job: Job) -> bool:
    """Whether the worker's last attempt recorded an end other than a stop (FINISHED, or FAILED)."""
    with contextlib.suppress(*CONNECTION_ERRORS):
        job.mirror.pull(job.transport)
    job.mirror.scan()
    end = job.mirror.end
    data = end.data if end is not None and isinstance(end.data, dict) else {}
    return end is not None and RunStatus.from_worker(data.get("status")) is not RunStatus.KILLED


def check_resume_point(job: Job) -> None:
    """A run picked up from elsewhere resumes where its stream state says (its own state file, or its tags):
    read the host's log first and check that the cursor lies on it, at a line's end, just after the event it
    names. Anything else (a tag forged or a log that changed) is said in one line, and the log is applied
    from its start; MLflow keeps one row per metric, step, time and value, so nothing lands twice and
    nothing is skipped on a cursor's word."""
    state = job.state
    if state.offset == 0 and state.last_seq == -1:
        return
    with contextlib.suppress(*CONNECTION_ERRORS):  # what cannot be read now is checked against what was
        job.mirror.pull(job.transport)
    problem = job.mirror.cursor_problem(state.offset, state.last_seq)
    if problem is None:
        return
    job.live.note(
        f"[yellow]run {state.run_id[:8]}: its stream cursor (offset {state.offset}, seq {state.last_seq}) "
        f"{problem}: its event log is applied from the start[/yellow]"
    )
    state.offset, state.last_seq = 0, -1


def follow(job: Job) -> WorkerStatus:
    orch = job.config.orchestrator
    settings = FollowSettings(
        poll_interval_s=orch.poll_interval_s,
        reconnect_budget_s=job.config.host.reconnect_budget_s,
        start_timeout_s=max(0.0, orch.start_timeout_s - job.started_s_ago),
        stall_warning_s=orch.stall_warning_s,
        exit_grace_s=orch.kill_grace_s,
    )
    follower = Follower(
        job.transport, job.state.run_dir, job.mirror, job.applier, job.live, settings, job.check_interrupt
    )
    return follower.run()


def request_cancel(transport: Transport, run_dir: str) -> None:
    """Mark the run as cancelled by the user, before its worker is stopped: whoever follows it (another
    orchestrator now, an `attach` later) then reads the stop as the cancel it was, not as a crash."""
    transport.write_file(posixpath.join(run_dir, CANCEL_REQUEST_FILE), f"{CANCELLED_BY_USER}\n".encode(), 0o600)


def _cancel_requested(job: Job) -> bool:
    path = posixpath.join(job.state.run_dir, CANCEL_REQUEST_FILE)
    return bool(_quietly(lambda: job.transport.read_bytes(path, 0, 64).decode(errors="replace")))


def conclude(job: Job, status: WorkerStatus) -> Outcome:
    """How the worker ended, from what it recorded: its `end` event first, its exit code otherwise.

    A worker stopped (or gone) after `cancel` marked the run ends KILLED as the user's cancel; one whose
    `end` says it finished or failed on its own keeps that."""
    with contextlib.suppress(CommandFailed, *CONNECTION_ERRORS):  # a launch that failed left it; no secret stays
        forget_env(job.transport, job.state.run_dir)
    end = job.mirror.end
    data = end.data if end is not None and isinstance(end.data, dict) else {}
    on_its_own = end is not None and RunStatus.from_worker(data.get("status")) is not RunStatus.KILLED
    if not on_its_own and _cancel_requested(job):
        if job.config.command.value != "cancel":  # the cancel command itself says it its own way
            job.live.note("[yellow]the run was cancelled by the user (`cancel=` from another command)[/yellow]")
        return Outcome(RunStatus.KILLED, CANCELLED_BY_USER, Stage.CANCEL, CANCELLED_ELSEWHERE_EXIT)
    if end is not None:
        job.summary = dict(data.get("summary") or {})
        worker_status_ = RunStatus.from_worker(data.get("status"))
        error = None if worker_status_ is RunStatus.FINISHED else str(data.get("error") or "the worker said so")
        return Outcome(worker_status_, error, None if error is None else Stage.WORKER)
    if status.state == "missing" and job.state.last_seq < 0:  # no folder, and no event was ever read
        return _never_launched(job)
    problem = _quietly(lambda: workdir_problem(job.transport, job.config.host.workdir))
    cause = f"; {problem}" if problem else ""
    return Outcome(RunStatus.FAILED, f"{status.describe()} before reporting an end event{cause}", Stage.WORKER)


def _never_launched(job: Job) -> Outcome:
    """A run with no folder on its host and no event read: its orchestrator stopped (killed, its machine
    down) before it launched the worker. A partial code upload it left, named for the run, goes now."""
    try:
        removed = remove_abandoned_parts(job.transport, job.config.host.workdir, job.state.run_id)
    except (CommandFailed, ValueError, *CONNECTION_ERRORS):
        removed = False
    if removed:
        return Outcome(
            RunStatus.FAILED,
            "the worker never started: the orchestrator that started this run stopped during the code sync "
            "(its partial upload is now removed from the host)",
            Stage.SYNC,
        )
    return Outcome(
        RunStatus.FAILED,
        "the worker never started: the orchestrator that started this run stopped before launching it "
        "(the run has no folder on the host)",
        Stage.LAUNCH,
    )


def stop(job: Job, reason: str, grace_s: float | None = None) -> Outcome:
    """Ctrl-C, cancel, a cancelled sweep, Slurm: stop the worker and read what it wrote last.

    The end is what the worker recorded: one that had ended on its own (FINISHED or FAILED in its `end`
    event, read now or before) keeps its status; one our SIGTERM stopped ends KILLED with our reason.
    `grace_s`: SIGTERM to SIGKILL; the job's own (a Slurm job's fits Slurm's KillWait), else
    orchestrator.kill_grace_s."""
    grace_s = next((g for g in (grace_s, job.stop_grace_s) if g is not None), job.config.orchestrator.kill_grace_s)
    if job.launched:
        job.live.note(f"[yellow]{reason}: stopping the worker[/yellow]")
        for attempt in (1, 2):  # a dropped connection gets one fresh one: the stop must not give up lightly
            try:
                final = stop_worker(job.transport, job.state.run_dir, grace_s)
                job.mirror.pull(job.transport)
                job.mirror.scan()
                break
            except NotProven as refusal:
                raise HostLost(f"{job.host_label}: {refusal}; the run stays RUNNING") from refusal
            except CONNECTION_ERRORS as exc:
                if attempt == 2:
                    raise HostLost(
                        f"{job.host_label}: could not stop the worker ({exc}); stop it later with "
                        f"`{cancel_command(job.config, job.state.run_id)}`"
                    ) from exc
                with contextlib.suppress(*CONNECTION_ERRORS):
                    job.transport.reconnect()
        # SIGKILL did not end its process group: the run is not over, and the command says what lives on.
        if final.state in ("running", "waiting"):
            raise HostLost(
                f"{job.host_label}: the worker of {job.state.run_id[:8]} did not stop ({final.describe()}, pid "
                f"{final.pid}); stop it with `{cancel_command(job.config, job.state.run_id)}`"
            )
        if job.mirror.end is not None:
            recorded = conclude(job, WorkerStatus("exited"))
            if recorded.status is not RunStatus.KILLED:
                return recorded
    return Outcome(RunStatus.KILLED, reason, Stage.CANCEL)


def slurm_stop(job: Job, stopped: SlurmStopped) -> Outcome:
    """Slurm is stopping the job: stop the worker within Slurm's KillWait and end the run as Slurm meant it
    (`sweep/slurm.py`): scancel → KILLED, the time limit → FAILED, a requeue → left RUNNING for the job
    Slurm starts again, which resumes it. A sweep cancelled meanwhile (Ctrl-C scancels its jobs) keeps its
    own reason, and a worker that had ended on its own keeps its end."""
    fields = job_fields(stopped.job.job_id)
    why = why_stopped(stopped.job, fields)
    said = " ".join(
        f"{key}={fields[key]}" for key in ("JobState", "Reason", "RunTime", "TimeLimit", "Restarts") if key in fields
    )
    job.live.note(f"{stopped}: {why.value} (scontrol: {said or 'no answer'})")
    swept = job.sweep.cancelled() if job.sweep is not None else None
    slurm_job = stopped.job.job_id
    if swept is not None:
        return stop(job, f"cancelled: {swept}", STOP_GRACE_S)
    if _cancel_requested(job):  # `cancel=<run>` scancels a Slurm-run run after leaving its mark
        outcome = stop(job, CANCELLED_BY_USER, STOP_GRACE_S)
        killed = outcome.status is RunStatus.KILLED
        return Outcome(RunStatus.KILLED, CANCELLED_BY_USER, Stage.CANCEL) if killed else outcome
    if why is SlurmEnd.REQUEUED:
        reason = f"requeued by Slurm (job {slurm_job}): the job resumes this run when Slurm starts it again"
    elif why is SlurmEnd.TIME_LIMIT:
        reason = f"Slurm time limit{time_limit_text(fields)} reached: job {slurm_job} stopped, and its worker"
    else:
        reason = f"cancelled by Slurm (job {slurm_job} was cancelled: scancel, or an administrator)"
    outcome = stop(job, reason, STOP_GRACE_S)
    if outcome.status is not RunStatus.KILLED or outcome.error != reason:  # it had ended on its own, or `cancel=`
        return outcome
    if why is SlurmEnd.REQUEUED:
        _apply_all(job)
        with outages_named():
            job.client.set_tag(job.state.run_id, tags.SLURM_REQUEUED, str(stopped.job.restarts + 1))
        return Outcome(RunStatus.DETACHED, reason, Stage.SLURM)  # left for the job Slurm starts again
    status = RunStatus.FAILED if why is SlurmEnd.TIME_LIMIT else RunStatus.KILLED
    return Outcome(status, reason, Stage.SLURM)


def collect(job: Job, outcome: Outcome) -> None:
    """Apply every event still waiting (waiting for MLflow if it must), then log the run's files.

    The events decide the run; the files are extras: one that cannot be fetched or logged (other than
    because MLflow is out of reach) is a warning, never a different status."""
    if job.launched or job.mirror.size:
        _apply_all(job)
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
            if _fetch(job, name, local):
                _log_file(job, local)
                if name == RUN_PROMPTS_FILE:
                    _log_prompt_set(job, local)
                if name == STDERR_FILE:
                    text = local.read_text(encoding="utf-8", errors="replace")
                    job.stderr_tail = text.splitlines()[-STDERR_TAIL_LINES:]
        summary = Path(tmp) / SUMMARY_FILE
        if outcome.status is RunStatus.FINISHED and _fetch(job, SUMMARY_FILE, summary):
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


def _describe(job: Job, summary: Path, tmp: Path) -> None:
    """The job's page answers the comparison: the table as its description and as files, the generations
    as an MLflow table (one row per prompt and method)."""
    document = json.loads(summary.read_text(encoding="utf-8"))  # the run's own settings, also on attach
    temperature = float(document.get("temperature") or 0)
    title = f"{document.get('model')} · {document.get('dtype')} · T={temperature:g} · {job.host_label}"
    rendered = summarize(document, title)
    with outages_named():
        job.client.set_tag(job.state.run_id, tags.NOTE, rendered.markdown)
    files = [("summary.md", rendered.markdown), ("summary.csv", rendered.csv)]
    if rendered.budget_csv is not None:
        files.append(("budget_curve.csv", rendered.budget_csv))
    for name, text in files:
        (tmp / name).write_text(text, encoding="utf-8")
        _log_file(job, tmp / name)
    generations = tmp / GENERATIONS_FILE
    with outages_named():
        logged = {a.path for a in job.client.list_artifacts(job.state.run_id)}
    if GENERATIONS_TABLE not in logged and _fetch(job, GENERATIONS_FILE, generations):  # log_table appends
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
    if _fetch(job, SPEC_FILE, spec):
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


def _describe_unfinished(job: Job, outcome: Outcome) -> None:
    """A run that did not finish says so on its page, and which of its methods decoded before the end; a
    method run the end came before says it was not reached (rather than an empty page, KILLED like the rest).
    An extra: what MLflow cannot take now is left out."""
    status, why = outcome.status.value, redact_text(outcome.error or "")
    try:
        with outages_named():
            reached, missed = [], []
            for scope, run_id in job.state.children.items():
                (reached if job.client.get_run(run_id).data.metrics else missed).append(scope)
            for scope in missed:
                note = f"**Not reached**: the run ended {status} before {scope} decoded anything ({why})."
                job.client.set_tag(job.state.children[scope], tags.NOTE, note)
            page = f"**{status}**: {why}" if why else f"**{status}**"
            if job.state.children:
                page += "\n\nDecoded before the end: " + (", ".join(reached) or "none")
                page += ("; not reached: " + ", ".join(missed)) * bool(missed) + "."
            if tags.NOTE not in job.client.get_run(job.state.run_id).data.tags:
                job.client.set_tag(job.state.run_id, tags.NOTE, page)
    except Exception as exc:  # noqa: BLE001 - the end itself matters more than its description
        job.live.note(f"[yellow]no description: {type(exc).__name__}: {short_reason(exc)}[/yellow]")


def leave_for_attach(job: Job, reason: str) -> Outcome:
    """The worker goes on (or has ended) but this process cannot finish the run: say how to pick it up."""
    command = attach_command(job.config, job.state.run_id)
    if not job.tracking_down:
        with contextlib.suppress(TrackingUnavailable, KeyboardInterrupt), outages_named():
            mark_detached(job.client, job.state.run_id, command)
    return Outcome(RunStatus.DETACHED, redact_text(reason))


# -- the one place failures are given their meaning --------------------------------------------------------


def lifecycle(job: Job, body: Callable[[Job], Outcome]) -> Outcome:
    """Run `body`, then collect and finish whatever happened; return how the job ended."""
    try:
        try:
            outcome = body(job)
        except PhaseFailed as exc:
            _stop_quietly(job)
            outcome = Outcome(RunStatus.FAILED, exc.message, exc.stage)
        except (UnsafePath, NotProven) as exc:
            outcome = refused(job, exc)
        except SlurmStopped as exc:
            job.stopping()
            job.interrupted = True
            outcome = slurm_stop(job, exc)
        except (KeyboardInterrupt, Interrupted, SweepCancelled) as exc:
            job.stopping()
            job.interrupted = True
            reason = f"cancelled: {exc}" if isinstance(exc, SweepCancelled) else str(exc) or "interrupted (Ctrl-C)"
            if isinstance(exc, KeyboardInterrupt):
                reason = "interrupted by the user (Ctrl-C)"
            outcome = stop(job, reason)
        if outcome.status is RunStatus.DETACHED:
            if outcome.stage in (Stage.SLURM, Stage.FOLLOW):  # requeued (resumed by Slurm's next start), or refused
                return outcome
            return leave_for_attach(job, outcome.error or "")
        collect(job, outcome)
        finish(job, outcome)
        return outcome
    except HostLost as exc:
        return leave_for_attach(job, f"{exc}; the run stays RUNNING and its worker goes on if it can")
    except TrackingUnavailable as exc:
        job.tracking_down = True
        what = "has ended" if job.mirror.end is not None or not job.launched else "goes on"
        return leave_for_attach(
            job, f"MLflow unreachable ({exc}); the worker {what}, and `attach` applies what is waiting, exactly once"
        )
    except (KeyboardInterrupt, Interrupted, SweepCancelled, SlurmStopped):
        # A second Ctrl-C while collecting: the events are safe in the local state; attach finishes the run.
        return leave_for_attach(job, "interrupted while finishing the run")
    except Exception as exc:  # noqa: BLE001 - local by elimination: named, the worker stopped, the run ended
        return _local_failure(job, exc)


def refused(job: Job, exc: UnsafePath | NotProven) -> Outcome:
    """The run's folder holds what the safe file layer refuses (a link, not a regular file) or its worker is not
    proven the run's: a run started elsewhere (attach, cancel) is left exactly as it was, with the one line;
    a run this command launched ends FAILED at stage `follow`, its worker stopped if it is proven its own."""
    message = f"{job.host_label}: {exc}"
    if job.config.command in (Command.ATTACH, Command.CANCEL):
        return Outcome(RunStatus.DETACHED, f"{message}; nothing was changed", Stage.FOLLOW)
    _stop_quietly(job)
    return Outcome(RunStatus.FAILED, message, Stage.FOLLOW)


def _local_failure(job: Job, exc: Exception) -> Outcome:
    """This machine failed: stop the worker (never orphaned), end the run FAILED at stage `local`; where either
    cannot be done (the host or MLflow is out of reach too), say so and leave the run for attach."""
    if isinstance(exc, LocalFailure):
        message = f"local: {exc}"
    else:
        crash = job.store.dir / f"{job.state.run_id}.crash.txt"
        with contextlib.suppress(OSError, UnsafePath):
            job.store.files.write_whole(crash.name, redact_text(traceback.format_exc()).encode())
        message = f"local: orchestrator error {type(exc).__name__}: {exc} (traceback in {crash})"
    message = redact_text(message)
    if job.launched:
        try:
            stop_worker(job.transport, job.state.run_dir, job.config.orchestrator.kill_grace_s)
        except Exception as stop_error:  # noqa: BLE001 - the host is gone too: the run must stay findable
            detail = f"{message}; the worker could not be stopped ({type(stop_error).__name__})"
            return leave_for_attach(job, f"{detail}: `{cancel_command(job.config, job.state.run_id)}` stops it")
    outcome = Outcome(RunStatus.FAILED, message, Stage.LOCAL)
    try:
        with outages_named():
            end_run(job.client, [*job.state.children.values(), job.state.run_id], outcome)
    except Exception:  # noqa: BLE001 - MLflow cannot take the end now: attach ends the run later
        job.tracking_down = True
        return leave_for_attach(job, f"{message}; MLflow could not record the end")
    return outcome


# -- helpers ----------------------------------------------------------------------------------------------


def worker_spec(config: JobConfig, run_id: str, run_dir: str, prompts_sent: bool = False) -> dict[str, Any]:
    """The spec file: only what the worker needs (never host, tracking or orchestrator settings).

    prompts_sent: the run folder holds the prompt set the orchestrator chose (`experiment.prompts_file`)."""
    sections = config.worker_sections
    experiment = dict(sections["experiment"], **({"prompts_file": RUN_PROMPTS_FILE} if prompts_sent else {}))
    return {
        "run_id": run_id,
        "run_dir": run_dir,
        "seed": config.seed,
        "experiment": experiment,
        "model": sections["model"],
        "decode": sections["decode"],
        "probe": sections["probe"],
    }


def _python(job: Job) -> str:
    import sys

    return job.config.host.python or sys.executable


def _apply_all(job: Job) -> None:
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
                f" with {job.applier.waiting} events waiting"
            )
        if not said:
            job.live.note(
                f"[yellow]the worker has ended; waiting up to {wait:g}s for MLflow "
                "(Ctrl-C leaves the run for attach)[/yellow]"
            )
            said = True
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def _fetch(job: Job, name: str, local: Path) -> bool:
    try:
        return job.transport.fetch(posixpath.join(job.state.run_dir, name), local)
    except CONNECTION_ERRORS as exc:
        job.live.note(f"[yellow]could not fetch {name} from {job.host_label}: {exc}[/yellow]")
        return False
    except UnsafePath as exc:  # a link or a special file where the run's file should be: never uploaded
        job.live.note(f"[yellow]{name} not logged: {escape(str(exc))}[/yellow]")
        return False


def _host_text(job: Job, name: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / name
        return local.read_text(encoding="utf-8", errors="replace") if _fetch(job, name, local) else ""


def _stop_quietly(job: Job) -> None:
    if job.launched:
        with contextlib.suppress(Exception):
            stop_worker(job.transport, job.state.run_dir, job.config.orchestrator.kill_grace_s)


def _quietly(call: Callable[[], str | None]) -> str | None:
    try:
        return call()
    except Exception:  # noqa: BLE001 - a diagnosis that fails adds nothing and must not hide the failure
        return None
