"""Runs one spec: start and env events, the experiment, and an `end` event whatever happens."""

from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path

from remote_worker import host_load, stop_signal
from remote_worker.events import EventLog
from remote_worker.probes.environment import environment_tags, probe_environment
from remote_worker.safe_files import Folder
from remote_worker.spec import SpecError, load_spec

TRACEBACK_FILE = "traceback.txt"
# transformers' advice when a GDN layer's CUDA kernels are not installed: a host without CUDA has no use for it
GPU_KERNEL_ADVICE = "is falling back to its reference PyTorch implementation"


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def run(spec_path: Path) -> int:
    """Return the process exit code: 0 finished, 1 failed, 128+N stopped by signal N."""
    run_dir = spec_path.resolve().parent
    log = EventLog(run_dir)
    start = {"pid": os.getpid(), "spec": spec_path.name}
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # the GPU lease the supervisor took for this worker
        start["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    log.emit("start", start)
    forwarding = LogEvents(log)
    # transformers' logger does not propagate to the root (outside CI), so it gets the handler itself.
    loggers = [logging.getLogger(), logging.getLogger("transformers")]
    for logger in loggers:
        logger.addHandler(forwarding)
    logging.getLogger("remote_worker").setLevel(logging.INFO)
    logging.captureWarnings(True)  # a library's warnings.warn (a deprecated argument, a slow path) too
    try:
        return _run(spec_path, run_dir, log)
    finally:
        for logger in loggers:
            logger.removeHandler(forwarding)
        logging.captureWarnings(False)


def _run(spec_path: Path, run_dir: Path, log: EventLog) -> int:
    try:
        spec = load_spec(spec_path)
        log.emit("env", environment_tags(probe_environment()))
        from remote_worker.experiments import EXPERIMENTS

        experiment = EXPERIMENTS.get(spec.experiment_name)
        if experiment is None:
            raise SpecError(
                f"spec: experiment.name={spec.experiment_name!r} is not one of: {', '.join(sorted(EXPERIMENTS))}"
            )
        with host_load.sampling(log):
            summary = experiment(spec, log)
        stop_signal.check()  # a stop swallowed on the way is still a stop, not a finished run
    except BaseException as exc:  # noqa: BLE001 - a stop or a failure, the log must say which
        signum = stop_signal.requested()
        if signum is None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            return _failed(log, run_dir, exc)
        # Stopped from outside (the orchestrator's SIGTERM on Ctrl-C): not a bug, so no traceback.
        reason = f"signal {signum}" if signum is not None else type(exc).__name__
        log.emit("end", {"status": "KILLED", "error": f"worker stopped by {reason}"})
        log.close()
        return 128 + signum if signum is not None else 130
    log.emit("end", {"status": "FINISHED", "summary": summary})
    log.close()
    return 0


class LogEvents(logging.Handler):
    """Python logging as `log` events: the worker's own INFO lines (what it is loading, how long it took) and
    every library's warnings, so they reach the terminal and the run's live `worker_log.txt` in MLflow."""

    REPEATS_SHOWN = 3  # the same message again after that is counted, not sent (a warning per token)

    def __init__(self, log: EventLog) -> None:
        super().__init__(logging.INFO)
        self.log = log
        self.seen: dict[str, int] = {}
        self._last: logging.LogRecord | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record is self._last or (record.levelno < logging.WARNING and not record.name.startswith("remote_worker")):
            return  # (a transformers record that also propagates to the root reaches this handler twice)
        self._last = record
        message = record.getMessage()
        if GPU_KERNEL_ADVICE in message and not _cuda():
            return  # advice to install a CUDA kernel (causal-conv1d, flash-linear-attention): nothing to do on a CPU
        self.seen[message] = self.seen.get(message, 0) + 1
        if self.seen[message] > self.REPEATS_SHOWN:
            return
        if self.seen[message] == self.REPEATS_SHOWN:
            message += " (repeated; further repeats are not logged)"
        try:
            level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
            self.log.emit("log", {"message": f"{level}{message}"[:2000], "logger": record.name})
        except Exception:  # noqa: BLE001 - a log line must never take the run down
            self.handleError(record)


def _failed(log: EventLog, run_dir: Path, exc: BaseException) -> int:
    text = "".join(traceback.format_exception(exc))
    Folder(run_dir).write_whole(TRACEBACK_FILE, text.encode("utf-8"))
    error_line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    log.emit("traceback", {"path": TRACEBACK_FILE, "error": error_line})
    log.emit("end", {"status": "FAILED", "error": error_line})
    log.close()
    return 1
