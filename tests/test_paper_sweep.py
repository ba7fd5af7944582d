"""`sweep=paper` end to end on the tiny trained pair over the local host with two GPU leases: the ten datasets
from a local mirror in the hub's layout, two prompts each and 8 new tokens, at temperature 1 (the command line's
`decode.temperature=1` narrows the grid's temperature axis: 10 jobs; where sampling seeds matter, for the shards).
Stopped with Ctrl-C mid-way and run again, it decodes only the jobs that did not finish and its page holds all
ten; the shards of one dataset merge into the figures of the whole set, tokens equal. Every prompt column of
the mirror carries every Unicode line separator, NUL, a BOM and CRLF (`tests/paper_mirror.py`, ODD_TEXT). The
grid of both temperatures (20 jobs) is planned and checked whole in the missing-set test below; the table's
T = 0 columns are `tests/test_paper_table.py`'s."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.sweep.paper.table import DATASETS
from orchestrator.tracking.markdown_table import plain_markdown
from tests.conftest import MlflowServer, group_alive, run_orchestrator, start_orchestrator
from tests.paper_mirror import build_mirror

pytestmark = pytest.mark.slow

TINY = ("experiment.num_prompts=2", "decode.max_new_tokens=8", "decode.tree_budgets=[4,16]", "decode.node_costs=false")
T1 = ("decode.temperature=1",)  # one temperature of the grid (10 jobs)


def paper_args(tmp_path: Path, mlflow_server: MlflowServer | None, sweep_dir: str, *extra: str) -> list[str]:
    tracking = ["tracking=server", f"tracking.uri={mlflow_server.uri}"] if mlflow_server is not None else []
    return [
        "--multirun", "sweep=paper", "model=tiny_trained", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
        "host.gpus=[0,1]", "model.device=cpu", f"experiment.datasets_dir={tmp_path / 'datasets'}", *TINY, *extra,
        f"host.workdir={tmp_path / 'work'}", f"orchestrator.state_dir={tmp_path / 'state'}",
        f"host.gpu_lock_dir={tmp_path / 'locks'}", *tracking, f"hydra.sweep.dir={tmp_path / sweep_dir}",
    ]  # fmt: skip


def parent_of(tmp_path: Path, sweep_dir: str) -> str:
    return json.loads((tmp_path / sweep_dir / "sweep.json").read_text())["parent_run_id"]


def jobs_of(client: MlflowClient, parent: str) -> dict[int, object]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent}'")
    return {int(r.data.tags["sweep.job"]): r for r in runs}


def artifact_text(client: MlflowClient, run_id: str, path: str, into: Path) -> str:
    into.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(into))).read_text()


def tokens_by_record(text: str) -> dict[str, dict[str, list[int]]]:
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {row["id"]: {scope: m["tokens"] for scope, m in row["methods"].items()} for row in rows}


def test_a_paper_sweep_stopped_and_run_again_decodes_only_what_is_missing(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    build_mirror(tmp_path / "datasets", rows_per_set=3, odd=True)  # every separator in every prompt column
    client = MlflowClient(tracking_uri=mlflow_server.uri)

    # First: stopped with Ctrl-C once at least four jobs have finished.
    process = start_orchestrator(paper_args(tmp_path, mlflow_server, "first", *T1), tmp_path, own_group=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            if (tmp_path / "first" / "sweep.json").is_file():
                runs = jobs_of(client, parent_of(tmp_path, "first")).values()
                if sum(r.info.status == "FINISHED" for r in runs) >= 4:
                    break
            time.sleep(0.5)
        # Ctrl-C to the launching process: it cancels the sweep, and the running jobs stop their workers.
        os.kill(process.pid, signal.SIGINT)
        first_out, first_err = process.communicate(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, first_out + first_err
    # 9 sets × 2 prompts + MT-Bench's 2 conversations × 2 turns; 4 methods each
    assert "plan: 10 jobs · 22 records · 88 decodes" in first_out
    first = jobs_of(client, parent_of(tmp_path, "first"))
    finished = {n for n, r in first.items() if r.info.status == "FINISHED"}
    assert 4 <= len(finished) < 10
    for pid_file in (tmp_path / "work" / "runs").glob("*/pid"):
        assert not group_alive(int(pid_file.read_text())), "no worker survives the Ctrl-C"

    # Again, the same command: the finished jobs are taken as they are, only the others are decoded.
    result = run_orchestrator(paper_args(tmp_path, mlflow_server, "second", *T1), tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    parent = client.get_run(parent_of(tmp_path, "second"))
    reused = {int(k.rsplit(".", 1)[1]): v for k, v in parent.data.tags.items() if k.startswith("sweep.reused.")}
    assert reused == {n: first[n].info.run_id for n in finished}
    decoded = jobs_of(client, parent.info.run_id)
    assert set(decoded) == set(range(10)) - finished, "nothing decoded twice, nothing missing"
    assert result.stdout.count("· already FINISHED with these") == len(finished)
    assert f"plan: 10/10 jobs done ({len(finished)} reused) in" in result.stdout
    assert parent.info.status == "FINISHED"

    # Its page holds all ten: the job table and the paper's table, every dataset.
    summary = list(
        csv.DictReader(io.StringIO(artifact_text(client, parent.info.run_id, "sweep_summary.csv", tmp_path / "a")))
    )
    assert {int(r["job"]) for r in summary} == set(range(10)) and {r["status"] for r in summary} == {"FINISHED"}
    assert {int(r["job"]) for r in summary if r["reused"] == "True"} == finished
    table = list(
        csv.DictReader(io.StringIO(artifact_text(client, parent.info.run_id, "paper_table.csv", tmp_path / "b")))
    )
    assert {(r["dataset"], r["temperature"]) for r in table} == {(d, "1") for d in DATASETS}
    assert {r["records"] for r in table if r["dataset"] != "mt-bench"} == {"2"}
    assert {r["records"] for r in table if r["dataset"] == "mt-bench"} == {"4"}  # two conversations, two turns each
    page = plain_markdown(parent.data.tags["mlflow.note.content"])
    assert page.startswith("### The paper's table: tiny_trained") and "| mt-bench |" in page
    # and the terminal's last screen is that table, 80 columns wide
    start = result.stdout.index("The paper's table: tiny_trained")
    screen = result.stdout[start:].splitlines()[:14]
    assert [line.split()[0] for line in screen[3:13]] == list(DATASETS) and screen[13].startswith("mean (10 sets)")
    assert max(len(line) for line in screen) <= 80

    # The shards of gsm8k at T = 1 decode exactly the records of the whole job, and merge into its figures.
    shards = run_orchestrator(
        paper_args(tmp_path, mlflow_server, "shards", "experiment.prompts=gsm8k", "decode.temperature=1",
                   "experiment.shard=0/2,1/2"),
        tmp_path, timeout=600,
    )  # fmt: skip
    assert shards.returncode == 0, shards.stdout + shards.stderr
    candidates = [client.get_run(run_id) for run_id in reused.values()] + list(decoded.values())
    whole_run = next(
        r.info.run_id for r in candidates
        if (r.data.params["experiment.prompts"], r.data.params["decode.temperature"]) == ("gsm8k", "1")
    )  # fmt: skip
    whole = tokens_by_record(artifact_text(client, whole_run, "generations.jsonl", tmp_path / "c"))
    pieces: dict[str, dict[str, list[int]]] = {}
    shard_parent = parent_of(tmp_path, "shards")
    for n, run in jobs_of(client, shard_parent).items():
        pieces |= tokens_by_record(artifact_text(client, run.info.run_id, "generations.jsonl", tmp_path / f"d{n}"))
    assert pieces == whole and len(whole) == 2
    merged = list(csv.DictReader(io.StringIO(artifact_text(client, shard_parent, "paper_table.csv", tmp_path / "e"))))
    alone = {r["method"]: r for r in table if (r["dataset"], r["temperature"]) == ("gsm8k", "1")}
    assert [(r["dataset"], r["records"]) for r in merged] == [("gsm8k", "2"), ("gsm8k", "2")]
    for row in merged:  # tau rests on the tokens alone (speed is timing, measured again: the best budget may move)
        if row["tree_budget"] == alone[row["method"]]["tree_budget"]:
            assert row["tau"] == alone[row["method"]]["tau"]


def test_a_paper_sweep_with_a_set_missing_starts_nothing_and_says_so_in_one_line(tmp_path: Path) -> None:
    """Every job's prompts are read before job #0: the missing set is one line with the command that fetches it
    (once, though both its temperatures' jobs need it), and no run, work folder or store is made."""
    root = build_mirror(tmp_path / "datasets", rows_per_set=2)
    shutil.rmtree(root / "MathArena")  # aime25: jobs #6 (T = 0) and #7 (T = 1)
    store = tmp_path / "mlruns.db"
    args = [*paper_args(tmp_path, None, "sweep"), "tracking=local", f"tracking.uri=sqlite:///{store}"]
    result = run_orchestrator(args, tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.strip() == "checking the prompts of 20 jobs"
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("config error: jobs #6, #7: experiment.prompts: aime25: MathArena/aime_2025 is not in ")
    assert line.endswith(f"download it with: hf download --repo-type dataset MathArena/aime_2025 --local-dir "
                         f"{root}/MathArena/aime_2025")  # fmt: skip
    assert not store.exists() and not (tmp_path / "work").exists() and not (tmp_path / "sweep" / "sweep.json").exists()


# The worker as `host.python` runs it, stopped (SIGSTOP) by the test's hook just after it lists phase 1's file: a
# job stopped between the phases at a point the test chooses, not one a timer races for.
STOP_AFTER_PHASE_1 = """
import os, runpy, signal, sys
from remote_worker import events
emit = events.EventLog.emit
def emit_then_stop(self, kind, data=None, *args, **kwargs):
    result = emit(self, kind, data, *args, **kwargs)
    if kind == "artifact" and data == {"path": "phase_1.json"}:
        os.kill(os.getpid(), signal.SIGSTOP)
    return result
events.EventLog.emit = emit_then_stop
sys.argv = ["remote_worker", *sys.argv[3:]]
runpy.run_module("remote_worker", run_name="__main__", alter_sys=True)
"""


def test_a_two_phase_job_stopped_between_the_phases_resumes_with_phase_two_only(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    build_mirror(tmp_path / "datasets", rows_per_set=18)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    hook = tmp_path / "stop_after_phase_1.py"
    hook.write_text(STOP_AFTER_PHASE_1)
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\nexec {sys.executable} {hook} "$@"\n'
    )
    python.chmod(0o755)

    def args(sweep_dir: str, *extra: str) -> list[str]:  # gsm8k at T = 0: one job, 18 records, 16 of them sampled
        return [
            "--multirun", "sweep=paper", "model=tiny_trained", "model.device=cpu", "experiment.prompts=gsm8k",
            "decode.temperature=0", "experiment.num_prompts=18", "decode.max_new_tokens=8",
            "decode.tree_budgets=[16]", "decode.node_costs=false", f"experiment.datasets_dir={tmp_path / 'datasets'}",
            f"host.workdir={tmp_path / 'work'}", f"orchestrator.state_dir={tmp_path / 'state'}",
            "tracking=server", f"tracking.uri={mlflow_server.uri}", f"hydra.sweep.dir={tmp_path / sweep_dir}", *extra,
        ]  # fmt: skip

    process = start_orchestrator(args("first", f"host.python={python}", "orchestrator.kill_grace_s=1"), tmp_path,
                                 own_group=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:  # until the orchestrator has received phase 1 and signed it
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            runs = (
                jobs_of(client, parent_of(tmp_path, "first")) if (tmp_path / "first" / "sweep.json").is_file() else {}
            )
            if runs and "orchestrator.phase_1_signature" in client.get_run(runs[0].info.run_id).data.tags:
                break
            time.sleep(0.2)
        os.kill(process.pid, signal.SIGINT)
        first_out, first_err = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, first_out + first_err
    stopped = client.get_run(runs[0].info.run_id)
    assert stopped.info.status == "KILLED"
    for pid_file in (tmp_path / "work" / "runs").glob("*/pid"):
        assert not group_alive(int(pid_file.read_text())), "no worker survives the Ctrl-C"

    result = run_orchestrator(args("second"), tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        f"sweep job #0 (1 of 1): phase 1 taken from run {stopped.info.run_id} (KILLED, stopped in phase 2, signed "
        "by this user): decoding phase 2 only" in " ".join(result.stdout.split())  # as the terminal folded it
    )
    resumed = jobs_of(client, parent_of(tmp_path, "second"))[0]
    assert resumed.info.status == "FINISHED"
    assert resumed.data.tags["orchestrator.phase_1_from"] == stopped.info.run_id
    events = [json.loads(line) for line in artifact_text(client, resumed.info.run_id, "events.jsonl",
                                                         tmp_path / "a").splitlines()]  # fmt: skip
    said = [str(e["data"].get("message")) for e in events if e["kind"] == "progress"]
    assert any(m.startswith("phase 2 · ") for m in said)
    assert not any(m.startswith("phase 1 · ") for m in said)  # no phase-1 decode ran again
    rows = [json.loads(line) for line in artifact_text(client, resumed.info.run_id, "generations.jsonl",
                                                       tmp_path / "b").splitlines()]  # fmt: skip
    assert [r["phase"] for r in rows] == [1] * 16 + [2] * 2
    summary = json.loads(artifact_text(client, resumed.info.run_id, "decode_summary.json", tmp_path / "c"))
    assert summary["protocol"]["restored"] is True
    assert summary["protocol"]["compared"] == summary["protocol"]["matched"] == 18  # exact on every record
    table = list(csv.DictReader(io.StringIO(artifact_text(client, parent_of(tmp_path, "second"), "paper_table.csv",
                                                          tmp_path / "d"))))  # fmt: skip
    assert {(r["dataset"], r["records"]) for r in table} == {("gsm8k", "18")}
