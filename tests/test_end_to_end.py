"""`python -m orchestrator` as a user runs it, against a real `mlflow server`, read back through MlflowClient."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from orchestrator.host.local import LocalTransport
from orchestrator.stream.events import split_events
from orchestrator.stream.sink import MlflowSink
from orchestrator.stream.state import StateStore
from orchestrator.tracking.markdown_table import plain_markdown
from remote_worker.decoding.figure_rules import AR_BY_DEFINITION
from remote_worker.experiments.decode_report import AR_AGAINST_ITSELF
from tests.conftest import JobPaths, MlflowServer, group_alive, run_orchestrator, start_orchestrator
from tests.test_sink import snapshot

pytestmark = pytest.mark.slow


def server_args(server: MlflowServer, paths: JobPaths, *extra: str) -> list[str]:
    return ["tracking=server", f"tracking.uri={server.uri}", *paths.overrides(), *extra]


def only_run_dir(paths: JobPaths) -> Path:
    run_dirs = paths.run_dirs()
    assert len(run_dirs) == 1, run_dirs
    return run_dirs[0]


def worker_metrics(run_dir: Path) -> dict[str, list[tuple[int, int, float]]]:
    """Every metric value the worker wrote for the job's own run, as (step, timestamp ms, value) per key."""
    return worker_metrics_for(run_dir, None)


def worker_metrics_for(run_dir: Path, scope: str | None) -> dict[str, list[tuple[int, int, float]]]:
    events, _ = split_events((run_dir / "events.jsonl").read_bytes())
    written: dict[str, list] = defaultdict(list)
    for event in events:
        if event.kind == "metrics" and event.scope == scope:
            for key, value in event.data.items():
                written[key].append((event.step or 0, event.timestamp_ms, float(value)))
    return {k: sorted(v) for k, v in written.items()}


def mlflow_metrics(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, int, float]]]:
    run = client.get_run(run_id)
    return {
        key: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))
        for key in run.data.metrics
    }


def download_text(client: MlflowClient, run_id: str, path: str, tmp_path: Path) -> str:
    return Path(client.download_artifacts(run_id, path, str(tmp_path))).read_text()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def workers_under(pid: int) -> list[int]:
    """The supervisor's children that are the worker by now (`python -m remote_worker`, after the exec)."""
    found = []
    for child in children_of(pid):
        try:
            if b"remote_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def test_probe_run_is_tracked_completely(mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path) -> None:
    # host.gpus=[0]: the run leases GPU slot 0 (a lock, CUDA_VISIBLE_DEVICES) even on a machine without one
    result = run_orchestrator(server_args(mlflow_server, job_paths, "experiment=probe", "host.gpus=[0]"), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(job_paths)
    run_id = run_dir.name
    assert run_id in result.stdout and "FINISHED" in result.stdout
    assert "native crop" in result.stdout

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "probe"
    # the experiment says it is a model-development one (MLflow's own tag), not a GenAI app's
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    params, tags = run.data.params, run.data.tags
    assert params["model.name"] == "tiny_trained" and params["host.name"] == "local"
    assert params["probe.model.class"] == "Qwen3_5ForCausalLM"
    assert params["probe.model.layer_type_counts"] == "full_attention=1, linear_attention=3"
    assert params["probe.cache.reports_croppable"] == "False"
    assert tags["host"] == "local" and tags["model"] == "tiny_trained"
    assert tags["remote.torch"].startswith("2.13.0") and tags["remote.transformers"]
    assert tags["remote.gpus"] == "none"
    assert len(tags["git.commit"]) in (40, len("unknown")) and tags["mlflow.source.git.commit"] == tags["git.commit"]
    assert "tracking=server" in tags["hydra.overrides"]
    assert run.data.metrics["probe.hybrid_cache.tree_verify_max_abs_diff"] < 1e-5
    assert run.data.metrics["probe.hybrid_cache.commit_logits_max_abs_diff"] < 1e-5
    assert tags["worker.status"] == "FINISHED"
    assert tags["worker.gpu"] == "0"

    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "probe.json", "events.jsonl", "stderr.log"} <= artifacts
    probe = json.loads(download_text(client, run_id, "probe.json", tmp_path))
    assert probe == json.loads((run_dir / "probe.json").read_text())
    assert probe["model"]["num_parameters"] == run.data.metrics["probe.model.num_parameters"]
    config = yaml.safe_load(download_text(client, run_id, "config.yaml", tmp_path))
    assert config["model"]["name"] == "tiny_trained" and config["tracking"]["uri"] == mlflow_server.uri

    # Nothing lost, nothing duplicated: MLflow holds exactly what the worker wrote.
    assert mlflow_metrics(client, run_id) == worker_metrics(run_dir)

    # A new orchestrator process re-reading the same log (attach after a crash) changes nothing.
    before = snapshot(client, [run_id])
    states = StateStore(job_paths.state_dir)
    state = states.load(run_id)
    assert state is not None and state.offset == (run_dir / "events.jsonl").stat().st_size
    sink = MlflowSink(client, run.info.experiment_id, state, states, LocalTransport())
    raw = (run_dir / "events.jsonl").read_bytes()
    assert sink.apply(*split_events(raw)) == []
    assert snapshot(client, [run_id]) == before


def test_worker_exception_gives_failed_run_with_traceback(
    mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path
) -> None:
    # Preflight cannot know which classes the host's transformers has; the worker finds out and raises.
    args = server_args(mlflow_server, job_paths, "experiment=probe", "model.arch=NoSuchForCausalLM")
    result = run_orchestrator(args, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    run_id = only_run_dir(job_paths).name
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    error = run.data.tags["error"]
    assert error.startswith("ValueError: model.arch='NoSuchForCausalLM' is not a model class of transformers")
    assert run.data.tags["failure_stage"] == "worker"
    traceback_text = download_text(client, run_id, "traceback.txt", tmp_path)
    assert traceback_text.startswith("Traceback") and "load_model" in traceback_text
    assert "ValueError" in result.stdout


def test_missing_model_directory_is_a_preflight_failure(
    mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-model"
    args = server_args(mlflow_server, job_paths, "model.source=pretrained", f"model.path={missing}")
    result = run_orchestrator(args, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert job_paths.run_dirs() == [], "nothing is launched after a failed preflight"
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    failed = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.failure_stage = 'preflight'"
    )
    assert any(r.data.tags["error"] == f"local: model.path {missing} is missing or has no config.json" for r in failed)


def launched_supervisor(job_paths: JobPaths) -> tuple[Path, int]:
    """Once the worker is launched: its pid file and its supervisor's pid (the process group id)."""
    pid_file = wait_for(lambda: next(iter(job_paths.workdir.glob("runs/*/pid")), None), 120, "the worker's pid")
    return pid_file, int(wait_for(lambda: pid_file.read_text().strip(), 10, "pid file content"))


def test_worker_killed_by_sigkill_gives_failed_run(
    mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path
) -> None:
    process = start_orchestrator(server_args(mlflow_server, job_paths), cwd=tmp_path)
    try:
        pid_file, supervisor = launched_supervisor(job_paths)
        # The worker itself: the supervisor's first children are short-lived (`cat worker.env`, the subshell
        # before its exec), and killing one of those is a different failure.
        worker = wait_for(lambda: workers_under(supervisor), 10, "the worker process")[0]
        os.kill(worker, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1, stdout + stderr
    run_id = pid_file.parent.name
    run = MlflowClient(tracking_uri=mlflow_server.uri).get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == "worker was killed by signal 9 (exit code 137) before reporting an end event"
    assert run.data.tags["failure_stage"] == "worker"
    assert "killed by signal 9" in stdout
    assert wait_for(lambda: not group_alive(supervisor), 15, "the supervisor to be gone")


def test_ctrl_c_stops_the_worker_and_ends_the_run_killed(
    mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path
) -> None:
    process = start_orchestrator(server_args(mlflow_server, job_paths), cwd=tmp_path)
    try:
        pid_file, supervisor = launched_supervisor(job_paths)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, stdout + stderr
    assert wait_for(lambda: not group_alive(supervisor), 15, "the worker's process group to be gone")
    run = MlflowClient(tracking_uri=mlflow_server.uri).get_run(pid_file.parent.name)
    assert run.info.status == "KILLED"
    assert run.data.tags["error"] == "interrupted by the user (Ctrl-C)"


def test_decode_sweep_lands_as_child_runs(mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path) -> None:
    args = server_args(
        mlflow_server,
        job_paths,
        "experiment=ddtree_gdn",
        "experiment.prompts=humaneval_completion",
        "experiment.num_prompts=2",
        "decode.max_new_tokens=24",
        "decode.tree_budgets=[4,32]",
        "decode.repeats=2",
    )
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    process = start_orchestrator(args, cwd=tmp_path)
    progress_seen = []  # the job's `progress` tag, as a person refreshing the UI would see it
    try:
        run_dir = wait_for(lambda: job_paths.run_dirs() and job_paths.run_dirs()[0], 120, "the run folder")
        while process.poll() is None:
            value = client.get_run(run_dir.name).data.tags.get("progress")
            if value and (not progress_seen or progress_seen[-1] != value):
                progress_seen.append(value)
            time.sleep(0.2)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = run_dir.name
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(progress_seen) >= 3 and any("prompt 2/2 · tau" in value for value in progress_seen), progress_seen

    # The job's own page answers the comparison: headline metrics, the best method, a description.
    metrics, tags = run.data.metrics, run.data.tags
    for scope in ("ar", "dflash", "ddtree_tb4", "ddtree_tb32"):
        for key in ("tau", "tokens_per_s", "speedup_vs_ar", "lossless", "acceptance_length_mean"):
            by_definition = scope == "ar" and key in (*AR_BY_DEFINITION, *AR_AGAINST_ITSELF)  # AR's own run only
            assert (f"{scope}.{key}" in metrics) != by_definition, (scope, key)
    note = plain_markdown(tags["mlflow.note.content"])
    assert "| ddtree_tb32 |" in note and note.startswith("**DDTree-")  # the answer before the table
    # two prompts: no 95 % interval, so nothing is crowned, and the basis says why
    assert "best.method" not in tags and "best.speedup_vs_ar" not in metrics
    # (on a loaded machine every drafting method may run slower than AR, and the basis says that first)
    assert re.match(r"(slower than AR, as is every drafting method here; )?no method is crowned: ", tags["best.basis"])
    assert tags["best.basis"].endswith(" on 2 prompts, too few for a 95 % interval (at least 5)")
    assert f"\n\nBest: {tags['best.basis']}.\n" in note
    assert re.fullmatch(r"\d\d-\d\d \d\d:\d\d · tiny_trained T=0", run.info.run_name), run.info.run_name
    assert {"summary.md", "summary.csv", "generations_table.json", "worker_log.txt"} <= {
        a.path for a in client.list_artifacts(run_id)
    }
    assert "loaded tiny_trained (float32, cpu) and its draft in" in download_text(
        client, run_id, "worker_log.txt", tmp_path
    )
    inputs = run.inputs.dataset_inputs
    named = [(d.dataset.name, json.loads(d.dataset.profile)["num_rows"]) for d in inputs]
    assert named == [("humaneval_completion", 164)]
    table = json.loads(download_text(client, run_id, "generations_table.json", tmp_path))
    assert len(table["data"]) == 2 * 4 and "output" in table["columns"]
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    by_name = {child.info.run_name: child for child in children}
    assert set(by_name) == {"ar", "dflash", "ddtree_tb4", "ddtree_tb32"}
    for name, child in by_name.items():
        assert child.info.status == "FINISHED"
        metrics = child.data.metrics
        for key in (
            "tau",
            "tokens_per_s",
            "tokens_per_s_min",
            "tokens_per_s_max",
            "speedup_vs_ar",
            "speedup_vs_ar_min",
            "speedup_vs_ar_max",
            "lossless",
            "near_tie_divergences",
            "unexplained_divergences",
            "prefill_ms",
            "ttft_ms",
            "tpot_ms",
            "draft_ms_per_round",
            "tree_build_ms_per_round",
            "verify_ms_per_round",
            "commit_ms_per_round",
        ):
            assert key in metrics, (name, key)
        assert metrics["lossless"] == 1.0, name
        assert metrics["near_tie_divergences"] == metrics["unexplained_divergences"] == 0.0, name
        assert metrics["tokens_per_s_min"] <= metrics["tokens_per_s"] <= metrics["tokens_per_s_max"], name
        assert child.data.params["method"] == name.split("_")[0]
        params = child.data.params  # children of different jobs can be filtered and compared
        assert (params["model"], params["dtype"], params["seed"], params["prompts"]) == (
            "tiny_trained",
            "float32",
            "0",
            "humaneval_completion",
        )
        assert child.data.tags["host"] == "local"
        assert metrics["acceptance_length_mean"] == pytest.approx(metrics["tau"] - 1)
        # nothing lost or duplicated: the per-round history is exactly what the worker wrote
        assert mlflow_metrics(client, child.info.run_id) == worker_metrics_for(run_dir, name)
    assert by_name["ar"].data.metrics["tau"] == 1.0
    assert by_name["ddtree_tb32"].data.params["tree_budget"] == "32"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"decode_summary.json", "generations.jsonl", "prompts.jsonl", "plots"} <= artifacts
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == ["HumanEval/0", "HumanEval/1"]  # the set chosen here, sent with the run
    assert "def has_close_elements" in rows[0]["prompt"]
    for row in rows:
        assert set(row["methods"]) == set(by_name) and row["prefill_ms"] > 0
        for output in row["methods"].values():
            assert output["matches_ar"] is True and output["divergence"] is None
            assert output["tokens"] == row["methods"]["ar"]["tokens"] and len(output["decode_s_repeats"]) == 2
    plots = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert plots == {
        "plots/tau_speedup_vs_budget.png",
        "plots/acceptance_length_hist.png",
        "plots/budget_curve.png",
        "plots/acceptance_depth_rank.png",
    }
    files = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.md", "summary.csv", "budget_curve.csv"} <= files
    assert "lossless 1.00" in result.stdout


def test_a_launch_that_fails_leaves_no_worker_env(
    mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start command fails (a host whose `setsid` is broken): the run fails at the launch, and the file
    holding the worker's environment, secrets included, is not left in the run folder."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "setsid").write_text("#!/bin/sh\necho 'setsid: cannot set up a session' >&2\nexit 1\n")
    (stubs / "setsid").chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}{os.pathsep}{os.environ['PATH']}")
    args = server_args(mlflow_server, job_paths, "experiment=probe", "+host.env.HF_TOKEN=hf_notarealtoken")
    result = run_orchestrator(args, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the worker did not start: setsid: cannot set up a session" in result.stdout
    run_dir = only_run_dir(job_paths)
    assert (run_dir / "spec.json").exists() and not (run_dir / "worker.env").exists()
    assert "hf_notarealtoken" not in "".join(p.read_text(errors="replace") for p in run_dir.iterdir() if p.is_file())


REFUSED = [
    (
        "decode.tree_budgets=[8,8]",
        "config error: decode.tree_budgets=[8, 8] names budget 8 twice: give each budget once",
    ),
    (
        "empty",
        "config error: experiment.prompts: {file}:2: prompt 'empty' is 0 tokens long with model "
        "tiny_trained's tokenizer; a decode needs at least 2 (give it more text or leave it out)",
    ),
    (
        "one",
        "config error: experiment.prompts: {file}:2: prompt 'one' is 1 token long with model "
        "tiny_trained's tokenizer; a decode needs at least 2 (give it more text or leave it out)",
    ),
    (
        "decode.tree_budgets=[2030]",
        "config error: decode.tree_budgets: budget 2030 needs 2031 positions for its tree beside "
        "decode.max_new_tokens=64 and the longest prompt ('heldout-zipimport-0', 160 tokens), more than "
        "model tiny_trained's context of 2048; the largest budget that fits is 1823",
    ),
]


def refused_setting(setting: str, tmp_path: Path) -> tuple[str, Path]:
    """The override for `setting`: as given, or a prompt file whose second prompt is empty or one character."""
    prompts = tmp_path / "mine.jsonl"
    if setting in ("empty", "one"):
        content = "" if setting == "empty" else "x"
        lines = [{"id": "fine", "messages": [{"role": "user", "content": "def add(a, b):"}]},
                 {"id": setting, "messages": [{"role": "user", "content": content}]}]  # fmt: skip
        prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
        setting = f"experiment.prompts={prompts}"
    return setting, prompts


@pytest.mark.parametrize(("setting", "message"), REFUSED)
def test_inputs_the_worker_cannot_decode_are_refused_by_the_config_check(
    tmp_path: Path, setting: str, message: str
) -> None:
    """Each such input is refused by the config check the command runs before anything starts, in one line
    naming the fix (and the prompt's line); the command's exit 2 with nothing created is proven end to end
    below, the 2030 budget's also through the CLI in `test_tree_budget_limits`."""
    from orchestrator.config.validation import ConfigError
    from tests.test_validation import composed

    override, prompts = refused_setting(setting, tmp_path)
    with pytest.raises(ConfigError) as refused:
        composed([override])
    assert f"config error: {refused.value}" == message.format(file=prompts)


def test_an_input_the_worker_cannot_decode_is_refused_before_anything_starts(
    mlflow_server: MlflowServer, job_paths: JobPaths, tmp_path: Path
) -> None:
    """Refused with one line naming the fix and the prompt's line, exit 2: no run in MLflow, nothing on the
    host (one prompt a token long; the other refusals are the same check, in process above)."""
    setting, message = REFUSED[2]
    override, prompts = refused_setting(setting, tmp_path)
    client = MlflowClient(tracking_uri=mlflow_server.uri)

    def runs() -> int:
        return len(client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=5000))

    before = runs()
    result = run_orchestrator(server_args(mlflow_server, job_paths, override), tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == message.format(file=prompts)
    assert runs() == before
    assert job_paths.run_dirs() == []
