"""Apply worker events to MLflow exactly once and in order.

An event is applied only if its `seq` is the next one; after each batch the last applied `seq` and the
byte offset are saved (locally and as tags), so a restarted orchestrator resumes where this one stopped.
A crash between applying and saving replays a few events; that is harmless, because every effect is
idempotent: metrics carry the worker's timestamp (MLflow keeps one row per key, timestamp, step and value),
params are re-logged with the same value, tags and artifacts are overwritten with the same content.

A batch is a transaction as far as the stream state goes: the state moves only after MLflow took every
call of the batch. If the store stops answering half-way, the batch is sent again whole later, and the
idempotence above makes the calls that did land harmless to repeat.

What the worker wrote wrongly never stops the stream: a metric value that is not a number, an artifact
path outside the run folder, a `seq` that skips (a malformed line was set aside) are recorded as warnings
on the run; only the worker decides to stop.
"""

from __future__ import annotations

import posixpath
import re
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import (
    MAX_ENTITIES_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from orchestrator.config.redaction import redact, to_params
from orchestrator.host.transport import Transport, UnsafePath
from orchestrator.stream.events import Event, progress_text
from orchestrator.stream.state import StateStore, StreamState
from orchestrator.tracking import tags

# Kept for the tests and tools that name them from here.
SCOPE_TAG = tags.SCOPE
LAST_SEQ_TAG = tags.LAST_SEQ
OFFSET_TAG = tags.OFFSET
DETACHED_TAG = tags.DETACHED


RECENT_LOG_FILE = "worker_log.txt"
RECENT_LOG_LINES = 200
RECENT_LOG_EVERY_S = 10.0

# What MLflow accepts as a metric or param name, and what a child run's name may be here (it is quoted in a
# search filter, so no quotes): anything else from the worker is a warning, never a request MLflow refuses.
_KEY = re.compile(r"[\w\-. /]{1,250}")
_NAME = re.compile(r"[\w\-.]{1,200}")


@dataclass
class _Pending:
    metrics: list[Metric] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


class MlflowSink:
    """Turns the event stream of one job into MLflow calls on the job's run and its child runs."""

    def __init__(
        self,
        client: MlflowClient,
        experiment_id: str,
        state: StreamState,
        store: StateStore,
        transport: Transport,
        file_tags: Callable[[str, Path], dict[str, str]] | None = None,
    ) -> None:
        """`file_tags`: the tags the job's run takes for a file the worker listed, given its path in the run
        folder and the copy that was logged (a signature of what was received, `tracking/signing.py`)."""
        self.client = client
        self.file_tags = file_tags
        self.experiment_id = experiment_id
        self.state = state
        self.store = store
        self.transport = transport
        self.end: dict[str, Any] | None = None
        self.error: str | None = None
        self.warnings: list[str] = []
        self._unsent_warnings = False
        self._params_sent: dict[str, dict[str, str]] = defaultdict(dict)  # run → key → value, this process
        self.recent_log: deque[str] = deque(maxlen=RECENT_LOG_LINES)  # the worker's last log lines
        self._pending_log: list[str] = []
        self._recent_log_changed = False
        self._recent_log_sent_at = 0.0
        self._pending: dict[str, _Pending] = defaultdict(_Pending)

    # -- the public surface ---------------------------------------------------------------------------

    def apply(self, events: list[Event], end_offset: int) -> list[Event]:
        """Apply the new events among `events`; return those that were new.

        The state (last seq, offset) moves and is saved only once MLflow has taken the whole batch; an error
        from MLflow leaves it where it was, so the same events are applied again next time. The cursor tags
        (`orchestrator.last_seq`, `orchestrator.offset`) go in a call of their own after every other call
        of the batch succeeded: an `attach` from another machine trusts them, so they must never run ahead
        of what MLflow holds."""
        fresh = [event for event in events if event.seq > self.state.last_seq]
        offset = max(self.state.offset, end_offset)
        if not fresh and offset == self.state.offset and not self._unsent_warnings:
            return []
        expected = self.state.last_seq + 1
        try:
            for event in fresh:
                if event.seq != expected:
                    self._warn(f"event seq {event.seq} follows {expected - 1}: a line was skipped")
                self._apply_one(event)
                expected = event.seq + 1
            last_seq = fresh[-1].seq if fresh else self.state.last_seq
            if self.warnings:
                self._pending[self.state.run_id].tags[tags.EVENT_LOG_WARNINGS] = self._warnings_tag()
            self._flush()
            cursor = [RunTag(tags.LAST_SEQ, str(last_seq)), RunTag(tags.OFFSET, str(offset))]
            self.client.log_batch(self.state.run_id, tags=cursor)
        finally:
            self._pending.clear()
            new_log_lines, self._pending_log = self._pending_log, []
        if fresh and new_log_lines:  # taken once the batch is: a batch sent again adds no line twice
            self.recent_log.extend(new_log_lines)
            self._recent_log_changed = True
        self._unsent_warnings = False
        self.state.last_seq, self.state.offset = last_seq, offset
        self.store.save(self.state)
        return fresh

    def send_recent_log(self, *, now: bool = False) -> None:
        """Replace the job's `worker_log.txt` artifact with the worker's recent log lines, at most every
        RECENT_LOG_EVERY_S (MLflow cannot append to an artifact, so the file is rewritten whole).

        Outside any batch: an extra that fails raises for the caller to report, never undoes a batch."""
        if not self._recent_log_changed or (
            not now and time.monotonic() - self._recent_log_sent_at < RECENT_LOG_EVERY_S
        ):
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / RECENT_LOG_FILE
            path.write_text("\n".join(self.recent_log) + "\n", encoding="utf-8")
            self.client.log_artifact(self.state.run_id, str(path))
        self._recent_log_changed, self._recent_log_sent_at = False, time.monotonic()

    def record_warnings(self, lines: list[str]) -> None:
        """Warnings found outside the sink (malformed lines of the log), for the run's warning tag."""
        for line in lines:
            self._warn(line)

    def run_ids(self) -> list[str]:
        """The job's run and every child run, children first."""
        return [*self.state.children.values(), self.state.run_id]

    # -- events ---------------------------------------------------------------------------------------

    def _apply_one(self, event: Event) -> None:
        if event.scope is not None and not (isinstance(event.scope, str) and _NAME.fullmatch(event.scope)):
            self._warn(f"event seq {event.seq}: scope {str(event.scope)[:40]!r} is not a run name; skipped")
            return
        if event.step is not None and (isinstance(event.step, bool) or not isinstance(event.step, int)):
            self._warn(f"event seq {event.seq}: step {str(event.step)[:20]!r} is not an integer; skipped")
            return
        run_id = self._run_for(event.scope)
        data = event.data if isinstance(event.data, dict) else {}
        if event.kind in ("artifact", "traceback"):
            self._flush()  # files are logged at once, after everything the worker reported before them
            self._log_remote_file(run_id, str(data.get("path", "traceback.txt")))
        pending = self._pending[run_id]
        if event.kind == "start":
            pending.tags[tags.WORKER_PID] = str(data.get("pid", ""))
            if "cuda_visible_devices" in data:
                pending.tags[tags.WORKER_GPU] = str(data["cuda_visible_devices"])
        elif event.kind in ("env", "tags"):
            pending.tags.update({k: str(v)[:MAX_TAG_VAL_LENGTH] for k, v in redact(data).items() if _KEY.fullmatch(k)})
        elif event.kind == "params":
            sent = self._params_sent[run_id]
            for key, value in to_params(data, MAX_PARAM_VAL_LENGTH).items():
                if not _KEY.fullmatch(key) or sent.get(key, value) != value:
                    self._warn(f"event seq {event.seq}: param {key[:60]!r} is not a valid name or changed; skipped")
                    continue
                sent[key] = pending.params[key] = value
        elif event.kind == "metrics":
            step = event.step or 0
            for key, value in data.items():
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    self._warn(f"metric {key}={str(value)[:40]!r} at seq {event.seq} is not a number")
                    continue
                if not _KEY.fullmatch(key):
                    self._warn(f"event seq {event.seq}: {key[:60]!r} is not a valid metric name; skipped")
                    continue
                pending.metrics.append(Metric(key, number, event.timestamp_ms, step))
        elif event.kind == "traceback":
            self.error = str(data.get("error", "worker raised an exception"))
            pending.tags.update({tags.ERROR: self.error, tags.FAILURE_STAGE: "worker"})
        elif event.kind == "progress":  # where the worker is, on the job's page while it runs
            self._pending[self.state.run_id].tags[tags.PROGRESS] = progress_text(data)[:MAX_TAG_VAL_LENGTH]
        elif event.kind == "end":
            self.end = data
            pending.tags[tags.WORKER_STATUS] = str(data.get("status", "unknown"))
        elif event.kind == "log":
            when = time.strftime("%H:%M:%S", time.localtime(event.t))
            self._pending_log.append(f"{when} {event.scope + ': ' if event.scope else ''}{data.get('message', '')}")

    def _run_for(self, scope: str | None) -> str:
        if scope is None:
            return self.state.run_id
        if scope not in self.state.children:
            self.state.children[scope] = self._find_or_create_child(scope)
        return self.state.children[scope]

    def _find_or_create_child(self, scope: str) -> str:
        # A previous orchestrator may have created the child and died before saving its state.
        found = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{self.state.run_id}' and tags.`{tags.SCOPE}` = '{scope}'",
            max_results=1,
        )
        if found:
            return found[0].info.run_id
        child = self.client.create_run(
            self.experiment_id,
            run_name=scope,
            tags={tags.PARENT_RUN_ID: self.state.run_id, tags.SCOPE: scope, tags.HOST: self.state.host},
        )
        return child.info.run_id

    def _log_remote_file(self, run_id: str, relative: str) -> None:
        if relative.startswith("/") or ".." in relative.split("/"):
            self._warn(f"artifact path {relative[:80]!r} is not inside the run directory; not logged")
            return
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / posixpath.basename(relative)
            try:
                found = self.transport.fetch(posixpath.join(self.state.run_dir, relative), local)
            except UnsafePath as exc:  # a link out of the run folder, a FIFO: never uploaded
                self._warn(f"artifact {relative[:80]!r} not logged: {exc}")
                self._pending[run_id].tags[f"{tags.MISSING_ARTIFACT_PREFIX}{relative}"] = "refused: not a regular file"
                return
            if found:
                folder = posixpath.dirname(relative) or None
                self.client.log_artifact(run_id, str(local), artifact_path=folder)
                if self.file_tags is not None and run_id == self.state.run_id:
                    self._pending[run_id].tags.update(self.file_tags(relative, local))
            else:
                missing = f"{tags.MISSING_ARTIFACT_PREFIX}{relative}"
                self._pending[run_id].tags[missing] = "listed by the worker but not found"

    def _warn(self, line: str) -> None:
        if line not in self.warnings:
            self.warnings.append(line)
            self._unsent_warnings = True

    def _warnings_tag(self) -> str:
        return (f"{len(self.warnings)}: " + " | ".join(self.warnings[-3:]))[:MAX_PARAM_VAL_LENGTH]

    def _flush(self) -> None:
        """Send everything pending in as few `log_batch` calls as MLflow's per-call limits allow."""
        for run_id, pending in self._pending.items():
            metrics = pending.metrics
            params = [Param(k, v) for k, v in pending.params.items()]
            tags = [RunTag(k, v) for k, v in pending.tags.items()]
            while metrics or params or tags:
                batch_params = params[:MAX_PARAMS_TAGS_PER_BATCH]
                batch_tags = tags[:MAX_PARAMS_TAGS_PER_BATCH]
                batch_metrics = metrics[: MAX_ENTITIES_PER_BATCH - len(batch_params) - len(batch_tags)]
                self.client.log_batch(run_id, metrics=batch_metrics, params=batch_params, tags=batch_tags)
                metrics = metrics[len(batch_metrics) :]
                params = params[len(batch_params) :]
                tags = tags[len(batch_tags) :]
        self._pending.clear()
