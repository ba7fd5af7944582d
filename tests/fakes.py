"""In-memory stand-ins for a host and a tracking store, for lifecycle tests that take milliseconds.

`FakeHost` is a `Transport` whose file system is a dict and whose worker is a script of event lines: each
time the orchestrator looks (a status question or a read of the log), the worker writes its next lines.
It answers the launcher's fixed scripts by their `$0` name (launch, status, workdir-check), the preflight
by a canned report, and `kill` as a process group would. `FakeTracking` keeps what MLflow would keep (a
metric is one row per key, timestamp, step and value) and can be taken down and brought back.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mlflow.exceptions import MlflowException

from orchestrator.host.transport import CommandResult, command_result
from remote_worker.events import EVENTS_FILE

REPORT = {
    "python": "3.12.0",
    "torch": "2.13.0",
    "transformers": "5.6.0",
    "safetensors": "0.5",
    "numpy": "2.0",
    "gpus": [],
    "cuda": None,
    "flock": True,
    "workdir_free_gib": 100.0,
    "workdir_writable": True,
    "workdir_problem": None,
    "workdir_checked": "/",
    "paths": {},
}


def event_line(seq: int, kind: str, data: Any = None, *, scope: str | None = None, step: int | None = None) -> bytes:
    event: dict[str, Any] = {"seq": seq, "t": 1_700_000_000 + seq, "kind": kind}
    if scope is not None:
        event["scope"] = scope
    if step is not None:
        event["step"] = step
    event["data"] = {} if data is None else data
    return (json.dumps(event) + "\n").encode()


def decode_log(rounds: int = 12, status: str = "FINISHED") -> list[bytes]:
    """A worker's whole log: start, params, metrics per round in two scopes, end."""
    lines = [event_line(0, "start", {"pid": 4242}), event_line(1, "params", {"method": "all"})]
    for scope in ("ar", "ddtree_tb8"):
        for step in range(rounds):
            lines.append(
                event_line(len(lines), "metrics", {"acceptance_length": step % 5 + 1.0}, scope=scope, step=step)
            )
    lines.append(event_line(len(lines), "metrics", {"tau": 3.5}))
    lines.append(event_line(len(lines), "end", {"status": status, "summary": {"tau": 3.5}}))
    return lines


def renumber(lines: list[bytes]) -> list[bytes]:
    """The same events with `seq` 0, 1, 2, … again (after a test inserted one)."""
    renumbered = []
    for seq, line in enumerate(lines):
        event = json.loads(line)
        event["seq"] = seq
        renumbered.append((json.dumps(event) + "\n").encode())
    return renumbered


class Cut(ConnectionResetError):
    """The fake connection is down."""


@dataclass
class FakeWorker:
    lines: list[bytes]
    lines_per_look: int = 1
    starts: bool = True  # False: the start command fails before the supervisor writes its pid
    start_stderr: str = ""
    exit_code: int = 0
    handles_sigterm: bool = True  # writes `end` KILLED on SIGTERM, as the real worker does
    written: int = 0
    state: str = "none"  # none, running, exited
    pid: int = 4242
    silent_looks: int = 0  # looks during which the worker writes nothing (a long model load)


class FakeHost:
    """A `Transport` over an in-memory host with one scripted worker."""

    def __init__(self, worker: FakeWorker, name: str = "fakehost") -> None:
        self.name = name
        self.worker = worker
        self.files: dict[str, bytes] = {}
        self.run_dir = ""
        self.commands: list[list[str]] = []
        self.down = False
        self.stay_down = False  # reconnect fails too
        self.on_look: Callable[[FakeHost], None] = lambda host: None
        self.looks = 0
        self.foreign_uid = 0  # non-zero: the pid file names another user's process (a decoy)

    # -- the worker --------------------------------------------------------------------------------------

    def _look(self) -> None:
        """Time passes for the worker each time the orchestrator looks."""
        self.looks += 1
        self.on_look(self)
        worker = self.worker
        if worker.state != "running":
            return
        if worker.silent_looks > 0:
            worker.silent_looks -= 1
            return
        for _ in range(worker.lines_per_look):
            if worker.written < len(worker.lines):
                self._append(worker.lines[worker.written])
                worker.written += 1
        if worker.written == len(worker.lines):
            self._exit(worker.exit_code)

    def _append(self, line: bytes) -> None:
        path = posixpath.join(self.run_dir, EVENTS_FILE)
        self.files[path] = self.files.get(path, b"") + line

    def _exit(self, code: int) -> None:
        self.worker.state = "exited"
        self.files[posixpath.join(self.run_dir, "exit_code")] = f"{code}\n".encode()

    def _terminate(self, signal_name: str) -> None:
        worker = self.worker
        if worker.state != "running":
            return
        if signal_name == "-TERM" and not worker.handles_sigterm:
            return
        if signal_name == "-TERM":
            seq = worker.written
            self._append(event_line(seq, "end", {"status": "KILLED", "error": "worker stopped by SIGTERM"}))
        self._exit(143 if signal_name == "-TERM" else 137)

    # -- Transport -----------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self.down:
            raise Cut("connection reset by peer (fake)")

    def open(self) -> None:
        self._check()

    def reconnect(self) -> None:
        if self.down and not self.stay_down:
            self.down = False
        self._check()

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> CommandResult:
        self._check()
        argv = list(argv)
        self.commands.append(argv)
        out, err, code = "", "", 0
        if argv[:2] == ["sh", "-c"] and len(argv) > 3:
            script = argv[3]
            if script == "launch":
                self.run_dir = argv[4]
                if self.worker.starts:  # the supervisor reads worker.env and deletes it first
                    self.files.pop(posixpath.join(self.run_dir, "worker.env"), None)
                    self.worker.state = "running"
                    self.files[posixpath.join(self.run_dir, "pid")] = f"{self.worker.pid}\n".encode()
                else:
                    self.files[posixpath.join(self.run_dir, "stderr.log")] = self.worker.start_stderr.encode()
            elif script == "status":
                self.run_dir = argv[4]
                self._look()
                out = self._status()
            elif script == "remove-parts":  # the partial copies under $1 named for run $2
                parts = [p for p in self.files if p.startswith(argv[4] + "/") and f".part-{argv[5]}" in p]
                for part in parts:
                    del self.files[part]
                out = "removed\n" if parts else ""
            elif script == "ls":  # the run folders under $1
                prefix = argv[4].rstrip("/") + "/"
                out = "\n".join(sorted({p[len(prefix) :].split("/")[0] for p in self.files if p.startswith(prefix)}))
            elif script == "run-facts":  # $1 the work folder, $2 the run id (see orchestrator/host/proof.py)
                out = self._facts(posixpath.join(argv[4], "runs", argv[5]), argv[5])
            elif script == "workdir-check":
                out = "checked /\nfree_kib 100000000\nwritable\n"
            else:
                out = ""
        elif argv[0] == "kill":
            signal_name = argv[1]
            if signal_name == "-0":
                code = 0 if self.worker.state == "running" else 1
            else:
                self._terminate(signal_name)
        elif argv[:2] == ["rm", "-f"]:
            for path in argv[2:]:
                self.files.pop(path, None)
        elif len(argv) > 2 and argv[1] == "-c":  # the preflight script
            out = json.dumps(REPORT) + "\n"
        return command_result(argv, code, out, err, check)

    def _status(self) -> str:
        exit_file = posixpath.join(self.run_dir, "exit_code")
        if exit_file in self.files:
            return f"exited {self.files[exit_file].decode().strip()}"
        if posixpath.join(self.run_dir, "pid") in self.files:
            return f"running {self.worker.pid}" if self.worker.state == "running" else f"vanished {self.worker.pid}"
        if not any(p.startswith(self.run_dir + "/") for p in self.files):
            return "missing"  # never launched here (a worker that starts writes its pid at once)
        return "unstarted" if self.files.get(posixpath.join(self.run_dir, "stderr.log")) else "starting"

    def _facts(self, run_dir: str, run_id: str) -> str:
        """What the host shows of the run's folder and its worker: the fake's own folder and worker are the
        run's (a test that wants a decoy sets `foreign`)."""
        if not any(p.startswith(run_dir + "/") for p in self.files):
            return "folder missing\n"
        lines = ["me 1000", "folder 1000 700", "spec_time 1700000000"]
        if posixpath.join(run_dir, "pid") in self.files:
            pid = self.worker.pid
            lines.append(f"pid {pid}")
            if self.worker.state == "running":
                lines.append(f"proc {self.foreign_uid or 1000} {pid} {pid} 1700000001")
                lines += ["carries"] * (not self.foreign_uid)
        return "\n".join(lines) + "\n"

    def read_bytes(self, path: str, offset: int, limit: int) -> bytes:
        self._check()
        self._look()
        return self.files.get(path, b"")[offset : offset + limit]

    def file_size(self, path: str) -> int | None:
        self._check()
        return len(self.files[path]) if path in self.files else None

    def write_file(self, path: str, data: bytes, mode: int, *, exclusive: bool = False) -> None:
        self._check()
        if exclusive and path in self.files:
            raise FileExistsError(path)
        self.files[path] = data

    def create_file(self, path: str, data: bytes, mode: int) -> bool:
        self._check()
        if path in self.files:
            return False
        self.files[path] = data
        return True

    def make_dirs(self, path: str, mode: int) -> None:
        self._check()

    def fetch(self, path: str, local_path: Path) -> bool:
        self._check()
        if path not in self.files:
            return False
        local_path.write_bytes(self.files[path])
        return True

    code_snapshot = True

    def prepare_code(self, workdir: str, method: str, owner: str = "") -> tuple[str, bool]:
        self._check()
        return "/code/abc", False

    def close(self) -> None:
        return None

    # -- what a test asks --------------------------------------------------------------------------------

    def signals_sent(self) -> list[str]:
        return [argv[1] for argv in self.commands if argv[0] == "kill" and argv[1] != "-0"]

    def events_written(self) -> bytes:
        return self.files.get(posixpath.join(self.run_dir, EVENTS_FILE), b"")


@dataclass
class FakeRun:
    run_id: str
    experiment_id: str
    name: str
    status: str = "RUNNING"
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: set[tuple[str, int, int, float]] = field(default_factory=set)  # key, timestamp, step, value
    artifacts: dict[str, bytes] = field(default_factory=dict)
    start_time: int = 1_700_000_000_000

    def as_mlflow(self) -> Any:
        info = SimpleNamespace(
            run_id=self.run_id,
            experiment_id=self.experiment_id,
            status=self.status,
            start_time=self.start_time,
            end_time=None if self.status == "RUNNING" else self.start_time + 60_000,
            run_name=self.name,
        )
        latest = {key: value for key, _, _, value in sorted(self.metrics)}
        return SimpleNamespace(
            info=info, data=SimpleNamespace(tags=dict(self.tags), params=dict(self.params), metrics=latest)
        )

    def history(self) -> dict[str, list[tuple[int, int, float]]]:
        found: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
        for key, timestamp, step, value in self.metrics:
            found[key].append((step, timestamp, value))
        return {key: sorted(values) for key, values in found.items()}


class FakeTracking:
    """The part of MlflowClient the orchestrator uses, in memory, with an off switch."""

    def __init__(self, tracking_uri: str = "http://fake-mlflow:5000") -> None:
        self.tracking_uri = tracking_uri
        self.down = False
        self.experiments: dict[str, str] = {}
        self.experiment_tags: dict[str, dict[str, str]] = {}
        self.runs: dict[str, FakeRun] = {}
        self.calls = 0
        self.refused = 0
        self.fail_on_calls: set[int] = set()  # the store drops these calls only (by count): a flush cut half-way

    def _check(self, what: str) -> None:
        self.calls += 1
        if self.down or self.calls in self.fail_on_calls:
            self.refused += 1
            raise MlflowException(
                f"API request to {self.tracking_uri}/api/2.0/mlflow/{what} failed with exception "
                "HTTPConnectionPool(host='fake-mlflow', port=5000): Max retries exceeded (Caused by "
                "NewConnectionError('Failed to establish a new connection: [Errno 111] Connection refused'))"
            )

    def search_experiments(self, max_results: int | None = None) -> list:
        self._check("experiments/search")
        return [SimpleNamespace(experiment_id=i, name=n) for n, i in self.experiments.items()][:max_results]

    def get_experiment_by_name(self, name: str) -> Any:
        self._check("experiments/get-by-name")
        if name not in self.experiments:
            return None
        experiment_id = self.experiments[name]
        return SimpleNamespace(experiment_id=experiment_id, tags=dict(self.experiment_tags.get(experiment_id, {})))

    def create_experiment(self, name: str, artifact_location: str | None = None, tags: Any = None) -> str:
        self._check("experiments/create")
        self.experiments[name] = str(len(self.experiments) + 1)
        self.experiment_tags[self.experiments[name]] = dict(tags or {})
        return self.experiments[name]

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        self._check("experiments/set-experiment-tag")
        self.experiment_tags.setdefault(experiment_id, {})[key] = value

    def create_run(self, experiment_id: str, run_name: str | None = None, tags: Mapping[str, str] | None = None) -> Any:
        self._check("runs/create")
        run_id = hashlib.md5(f"run {len(self.runs) + 1}".encode()).hexdigest()  # ids that differ early, as MLflow's
        self.runs[run_id] = FakeRun(run_id, experiment_id, run_name or run_id, tags=dict(tags or {}))
        return self.runs[run_id].as_mlflow()

    def get_run(self, run_id: str) -> Any:
        self._check("runs/get")
        if run_id not in self.runs:
            raise MlflowException(f"Run '{run_id}' not found", error_code="RESOURCE_DOES_NOT_EXIST")
        return self.runs[run_id].as_mlflow()

    def search_runs(
        self,
        experiment_ids: Sequence[str],
        filter_string: str = "",
        max_results: int = 1000,
        order_by: Sequence[str] | None = None,
    ) -> list:
        """Tag equality filters only; newest first (runs are numbered in creation order)."""
        self._check("runs/search")
        wanted = dict(re.findall(r"tags\.`?([\w.]+)`? = '([^']*)'", filter_string))
        return [
            run.as_mlflow()
            for run in reversed(self.runs.values())
            if run.experiment_id in experiment_ids and all(run.tags.get(k) == v for k, v in wanted.items())
        ][:max_results]

    def log_batch(
        self, run_id: str, metrics: Sequence[Any] = (), params: Sequence[Any] = (), tags: Sequence[Any] = ()
    ) -> None:
        self._check("runs/log-batch")
        run = self.runs[run_id]
        for metric in metrics:
            run.metrics.add((metric.key, metric.timestamp, metric.step, metric.value))
        for param in params:
            if run.params.get(param.key, param.value) != param.value:
                raise MlflowException(f"param {param.key} changed", error_code="INVALID_PARAMETER_VALUE")
            run.params[param.key] = param.value
        for tag in tags:
            run.tags[tag.key] = tag.value

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self._check("runs/set-tag")
        self.runs[run_id].tags[key] = value

    def set_terminated(self, run_id: str, status: str | None = None) -> None:
        self._check("runs/update")
        self.runs[run_id].status = status or "FINISHED"

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        self._check("artifacts/upload")
        name = Path(local_path).name
        self.runs[run_id].artifacts[f"{artifact_path}/{name}" if artifact_path else name] = Path(
            local_path
        ).read_bytes()


def worker_histories(log: bytes, scope: str | None) -> dict[str, list[tuple[int, int, float]]]:
    """Every metric the worker wrote for `scope`, as (step, timestamp ms, value), sorted per key."""
    found: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event["kind"] == "metrics" and event.get("scope") == scope:
            for key, value in event["data"].items():
                found[key].append((event.get("step") or 0, int(event["t"] * 1000), float(value)))
    return {key: sorted(values) for key, values in found.items()}
