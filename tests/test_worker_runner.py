"""`python -m remote_worker run SPEC.json` as a process: a bad spec fails cleanly, SIGTERM stops it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.stream.events import split_events
from tests import specs
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.worker  # also run under the oldest supported transformers (make test-compat)


def start_worker(run_dir: Path, spec: dict) -> subprocess.Popen:
    (run_dir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "remote_worker", "run", str(run_dir / "spec.json")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def events(run_dir: Path) -> list:
    return split_events((run_dir / "events.jsonl").read_bytes())[0]


def decode_spec(run_dir: Path) -> dict:
    return specs.decode_spec(run_dir, num_prompts=2, max_new_tokens=200, tree_budgets=[64])


def test_a_bad_spec_is_an_ordinary_failed_run(tmp_path: Path) -> None:
    spec = decode_spec(tmp_path)
    spec["model"]["dtype"] = "float17"
    process = start_worker(tmp_path, spec)
    assert process.wait(timeout=120) == 1
    log = events(tmp_path)
    assert [e.seq for e in log] == list(range(len(log)))
    assert [e.kind for e in log] == ["start", "traceback", "end"]
    assert log[-1].data == {
        "status": "FAILED",
        "error": "remote_worker.spec.SpecError: spec: model.dtype='float17' is not one of: "
        "float32, float64, bfloat16, float16",
    }
    assert (tmp_path / "traceback.txt").read_text().startswith("Traceback")


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0, 2.5])
def test_sigterm_at_any_moment_ends_the_run_killed(tmp_path: Path, delay: float) -> None:
    """SIGTERM may land in an import, in model building or mid-decode: the end is KILLED, never a traceback."""
    process = start_worker(tmp_path, decode_spec(tmp_path))
    deadline = time.monotonic() + 60
    while not (tmp_path / "events.jsonl").exists() or not events(tmp_path):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.01)
    time.sleep(delay)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM, process.stderr.read().decode()[-2000:]
    log = events(tmp_path)
    assert [e.seq for e in log] == list(range(len(log)))
    assert log[-1].kind == "end" and log[-1].data == {"status": "KILLED", "error": "worker stopped by signal 15"}
    assert not any(e.kind == "traceback" for e in log)


@pytest.mark.compat  # the worker process whole, decoding, under the oldest transformers too
def test_sampling_sweep_reports_no_lossless(tmp_path: Path) -> None:
    """At temperature > 0 outputs differ from AR's by design: every metric but `lossless` is reported."""
    spec = decode_spec(tmp_path)
    spec["decode"].update(temperature=0.8, max_new_tokens=12, tree_budgets=[8])
    spec["experiment"]["num_prompts"] = 1
    process = start_worker(tmp_path, spec)
    assert process.wait(timeout=180) == 0, process.stderr.read().decode()[-2000:]
    log = events(tmp_path)
    summaries = [e for e in log if e.kind == "metrics" and "tau" in e.data]
    assert {e.scope for e in summaries} == {"ar", "dflash", "ddtree_tb8"}
    assert all("lossless" not in e.data and e.data["tokens_per_s"] > 0 for e in summaries)
    assert log[-1].data["status"] == "FINISHED"
    layout = {k: v for e in log if e.kind == "params" and e.scope is None for k, v in e.data.items()}
    assert layout["layout.gdn_key_value_heads"] == "2/4 (r=2)" and layout["layout.draft_block_size"] == "8"


def test_a_stop_swallowed_by_library_code_still_ends_the_run_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM's SystemExit can land in code that swallows it (an import under a broad `except`); the work
    then returns normally, but the stop was asked for: the run ends KILLED, not FINISHED."""
    from remote_worker import experiments, runner, stop_signal

    def experiment_that_swallows(spec, log):
        with contextlib.suppress(BaseException):  # what some library code does
            stop_signal._handle(signal.SIGTERM, None)
        return {}

    monkeypatch.setattr(stop_signal, "_requested", None)
    monkeypatch.setitem(experiments.EXPERIMENTS, "probe", experiment_that_swallows)
    spec = decode_spec(tmp_path)
    spec["experiment"] = {"name": "probe"}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert runner.run(tmp_path / "spec.json") == 128 + signal.SIGTERM
    assert events(tmp_path)[-1].data == {"status": "KILLED", "error": "worker stopped by signal 15"}


def test_a_tree_budget_the_model_cannot_hold_fails_before_any_decode_in_one_line(tmp_path: Path) -> None:
    """`decode.tree_budgets=[100000]`: refused by the context (or the memory) check before the first prompt,
    never a raw allocator error mid-sweep."""
    spec = decode_spec(tmp_path)
    spec["decode"].update(max_new_tokens=8, tree_budgets=[16, 100_000])
    process = start_worker(tmp_path, spec)
    assert process.wait(timeout=180) == 1, process.stderr.read().decode()[-2000:]
    log = events(tmp_path)
    error = log[-1].data["error"]
    assert log[-1].data["status"] == "FAILED" and "decode.tree_budgets" in error and "\n" not in error, error
    assert error.startswith("ValueError: ") and ("context of" in error or "needs at least" in error), error
    assert not any(e.kind == "progress" and e.data.get("task") == "decode" for e in log)


def test_advice_to_install_cuda_kernels_is_not_passed_on_from_a_host_without_cuda(tmp_path: Path) -> None:
    """transformers warns, once per kernel, that a GDN layer falls back to PyTorch because causal-conv1d or
    flash-linear-attention is missing: advice for a CUDA host, noise on a CPU (it was 11 lines of a probe's
    80-column screen). Other warnings still come through."""
    import logging

    from remote_worker.events import EventLog
    from remote_worker.runner import GPU_KERNEL_ADVICE, LogEvents

    log = EventLog(tmp_path)
    handler = LogEvents(log)
    advice = f"`chunk_gated_delta_rule` {GPU_KERNEL_ADVICE} because `flash-linear-attention` is not installed."
    for message in (advice, "a deprecated argument"):
        handler.emit(logging.LogRecord("transformers", logging.WARNING, __file__, 1, message, None, None))
    log.close()
    said = [e.data["message"] for e in events(tmp_path) if e.kind == "log"]
    import torch

    expected = ["warning: a deprecated argument"]
    assert said == (expected if not torch.cuda.is_available() else [f"warning: {advice}", *expected])
