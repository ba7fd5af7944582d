"""A job's phases, in order: open host → preflight → sync → launch → follow → conclude.

Each is a short function that does one thing and turns the failures it expects into the error kinds of
`errors.py`; `outcomes.lifecycle` decides what each kind means for the run.
"""

from __future__ import annotations

import contextlib
import posixpath
import tempfile
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from orchestrator.config.prompts import prompts_file_text
from orchestrator.config.settings import JobConfig
from orchestrator.host.launch import forget_env, start_worker, wait_for_start, write_spec
from orchestrator.host.preflight import PreflightFailed, lease_candidates, run_preflight, workdir_problem
from orchestrator.host.run_folder import STDERR_FILE, WorkerStatus
from orchestrator.host.sync import remove_abandoned_parts
from orchestrator.host.transport import (
    CONNECTION_ERRORS,
    CommandFailed,
    ConnectFailed,
    HostKeyRefused,
    Transport,
    UnsafePath,
)
from orchestrator.lifecycle.errors import HostLost, PhaseFailed
from orchestrator.lifecycle.follow import Follower, FollowSettings
from orchestrator.lifecycle.job import (
    CANCEL_REQUEST_FILE,
    CANCELLED_BY_USER,
    Job,
    host_text,
    quietly,
    worker_python,
)
from orchestrator.tracking import tags
from orchestrator.tracking.client import TrackingUnavailable, outages_named
from orchestrator.tracking.status import CANCELLED_ELSEWHERE_EXIT, Outcome, RunStatus, Stage
from remote_worker.decoding.two_phase import PHASE_1_FILE
from remote_worker.prompt_set import RUN_PROMPTS_FILE


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
        report = run_preflight(job.transport, host, job.config.worker_sections["model"], worker_python(job))
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
        experiment = job.config.worker_sections["experiment"]
        prompts = prompts_file_text(experiment.get("prompts"), experiment.get("datasets_dir"))
        handed = job.handed_phase_1
        spec = worker_spec(
            job.config, job.state.run_id, run_dir, prompts_sent=prompts is not None, phase_1_sent=handed is not None
        )
        write_spec(job.transport, run_dir, spec, prompts, {PHASE_1_FILE: handed} if handed is not None else None)
        job.launched = True
        with contextlib.suppress(TrackingUnavailable, MlflowException), outages_named():
            # The run's folder exists from now on: attach and cancel refuse to end the run where it is missing.
            job.client.set_tag(job.state.run_id, tags.HOST_RUN_DIR, run_dir)
        start_worker(
            job.transport,
            run_dir,
            worker_python(job),
            code_dir,
            host.env,
            lease_candidates(host, report),
            host.gpu_lock_dir,
            held=job.transport.code_snapshot,
        )
    except (CommandFailed, *CONNECTION_ERRORS) as exc:
        with contextlib.suppress(CommandFailed, *CONNECTION_ERRORS):
            forget_env(job.transport, run_dir)
        problem = quietly(lambda: workdir_problem(job.transport, host.workdir))
        raise PhaseFailed(Stage.LAUNCH, f"{host.name}: {problem or f'could not start the worker: {exc}'}") from exc
    timeout = job.config.orchestrator.start_timeout_s
    try:
        status = wait_for_start(job.transport, run_dir, timeout, job.check_interrupt)
    except CONNECTION_ERRORS as exc:  # the worker may well be running: left for attach
        raise HostLost(f"{job.host_label}: connection lost just after the start: {exc}") from exc
    if status.state in ("starting", "unstarted"):
        stderr = host_text(job, STDERR_FILE).strip().splitlines()
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
    if job.handed_phase_1 is None and (own := own_phase_1(job.transport, job.state.run_dir)) is not None:
        job.handed_phase_1 = own
        job.live.note("phase 1 of the stopped attempt is whole: the worker goes on from it with phase 2")
    launch(job, report, code_dir)


def own_phase_1(transport: Transport, run_dir: str) -> bytes | None:
    """The run's own phase 1, which a two-phase worker writes whole into its private run folder when phase 1
    ends (`remote_worker.experiments.phase_one_state`): the attempt started again goes on from it; None where
    there is none (a grid run, or stopped before phase 1 ended) or it cannot be read."""
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / PHASE_1_FILE
        try:
            return local.read_bytes() if transport.fetch(posixpath.join(run_dir, PHASE_1_FILE), local) else None
        except (UnsafePath, *CONNECTION_ERRORS):
            return None


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


def cancel_requested(job: Job) -> bool:
    path = posixpath.join(job.state.run_dir, CANCEL_REQUEST_FILE)
    return bool(quietly(lambda: job.transport.read_bytes(path, 0, 64).decode(errors="replace")))


def conclude(job: Job, status: WorkerStatus) -> Outcome:
    """How the worker ended, from what it recorded: its `end` event first, its exit code otherwise.

    A worker stopped (or gone) after `cancel` marked the run ends KILLED as the user's cancel; one whose
    `end` says it finished or failed on its own keeps that."""
    with contextlib.suppress(CommandFailed, *CONNECTION_ERRORS):  # a launch that failed left it; no secret stays
        forget_env(job.transport, job.state.run_dir)
    end = job.mirror.end
    data = end.data if end is not None and isinstance(end.data, dict) else {}
    on_its_own = end is not None and RunStatus.from_worker(data.get("status")) is not RunStatus.KILLED
    if not on_its_own and cancel_requested(job):
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
    problem = quietly(lambda: workdir_problem(job.transport, job.config.host.workdir))
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


def worker_spec(
    config: JobConfig, run_id: str, run_dir: str, prompts_sent: bool = False, phase_1_sent: bool = False
) -> dict[str, Any]:
    """The spec file: only what the worker needs (never host, tracking or orchestrator settings).

    prompts_sent: the run folder holds the prompt set the orchestrator chose (`experiment.prompts_file`).
    phase_1_sent: and an earlier run's phase 1 to go on from (`experiment.phase_1_file`, `sweep/resume.py`)."""
    sections = config.worker_sections
    experiment = dict(sections["experiment"], **({"prompts_file": RUN_PROMPTS_FILE} if prompts_sent else {}))
    if phase_1_sent:
        experiment["phase_1_file"] = PHASE_1_FILE
    return {
        "run_id": run_id,
        "run_dir": run_dir,
        "seed": config.seed,
        "experiment": experiment,
        "model": sections["model"],
        "decode": sections["decode"],
        "probe": sections["probe"],
    }
