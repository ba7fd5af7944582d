"""What MLflow shows first on a job's pages, from a real decode job on the tiny hybrid model, applied to an
MLflow store the way the orchestrator applies it.

MLflow 3.17's run page lists a run's metrics in the order the store returns them, which is the order they
were first logged (the compare view and the charts sort names alphabetically instead), so what a page leads
with is decided by the worker's logging order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.host.local import LocalTransport
from orchestrator.stream.events import split_events
from orchestrator.stream.sink import MlflowSink
from orchestrator.stream.state import StateStore, StreamState
from orchestrator.tracking.job_summary import summarize
from remote_worker.events import EVENTS_FILE, EventLog
from remote_worker.experiments.ddtree_gdn import SUMMARY_FILE, run_ddtree_gdn
from remote_worker.figures import meaningful
from remote_worker.spec import parse_spec
from tests import specs


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[MlflowClient, str, dict[str, str], Path, dict[str, str]]:
    """One decode job (a prompt, AR, DFlash, DDTree-4) logged to a local MLflow store through the sink."""
    root = tmp_path_factory.mktemp("job")
    run_dir = root / "run"
    run_dir.mkdir()
    raw = specs.decode_spec(run_dir, num_prompts=1, model={"device": "cpu"}, max_new_tokens=12, tree_budgets=[4],
                            compile=False)  # fmt: skip
    log = EventLog(run_dir)
    terminal = run_ddtree_gdn(parse_spec(raw, run_dir), log)
    log.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment_id = client.create_experiment("ddtree_gdn", artifact_location=(root / "artifacts").as_uri())
    run_id = client.create_run(experiment_id).info.run_id
    states = StateStore(root / "state")
    state = StreamState(run_id=run_id, host="local", run_dir=str(run_dir))
    sink = MlflowSink(client, experiment_id, state, states, LocalTransport())
    events, consumed = split_events((run_dir / EVENTS_FILE).read_bytes())
    sink.apply(events, consumed)
    return client, run_id, dict(sink.state.children), run_dir, terminal


def test_a_methods_page_leads_with_its_headline_figures(job) -> None:
    client, _run_id, children, _run_dir, _terminal = job
    for scope in ("ar", "dflash", "ddtree_tb4"):
        listed = list(client.get_run(children[scope]).data.metrics)  # in the store's order: the page's
        assert listed[:4] == ["tau", "speedup_vs_ar", "tokens_per_s", "lossless"], scope
        assert listed[-1] == "round.accepted_tokens" and "acceptance_length" not in listed, scope


def test_the_per_round_series_is_named_per_round_and_holds_every_round(job) -> None:
    client, _run_id, children, run_dir, _terminal = job
    document = json.loads((run_dir / SUMMARY_FILE).read_text())
    for scope, lengths in document["acceptance_lengths"].items():
        history = sorted(client.get_metric_history(children[scope], "round.accepted_tokens"), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == list(enumerate(map(float, lengths))), scope
        child = client.get_run(children[scope]).data.metrics
        assert child["acceptance_length_mean"] == pytest.approx(sum(lengths) / len(lengths))


def test_the_jobs_page_leads_with_the_answer_and_crowns_nothing_on_one_prompt(job) -> None:
    client, run_id, _children, run_dir, terminal = job
    run = client.get_run(run_id)
    listed = list(run.data.metrics)
    prediction = json.loads((run_dir / SUMMARY_FILE).read_text())["prediction"]
    predicted = [] if prediction["cannot_tell"] else [
        "best.predicted_budget", "best.predicted_speedup_vs_ar", "best.predicted_tokens_per_s"
    ]  # fmt: skip
    # one prompt has no interval, so no best.* figures; the prediction's, where it answers; then its check
    assert listed[: len(predicted) + 3] == [*predicted, "budget.prediction_error", "budget.prediction_error_worst",
                                           "dflash.tau"]  # fmt: skip
    assert "best.method" not in run.data.tags
    basis = run.data.tags["best.basis"]
    assert "no method is crowned: " in basis and basis.endswith(
        " on 1 prompt, too few for a 95 % interval (at least 5)"
    )
    description = summarize(json.loads((run_dir / SUMMARY_FILE).read_text()), "t").markdown.splitlines()
    assert description[0].startswith("**DDTree-4**: tau ") and " · **DFlash**: tau " in description[0]
    assert description[2] == f"Best: {basis}."
    assert terminal["best"] == basis  # the terminal says the same


def test_the_jobs_page_draws_the_budget_curves_against_their_steps(job) -> None:
    """tau at every budget, the node costs against tree size and the predicted tokens/s are metric histories
    whose step is the budget (or the number of nodes): MLflow's chart of each is the curve."""
    client, run_id, _children, run_dir, _terminal = job
    document = json.loads((run_dir / SUMMARY_FILE).read_text())

    def history(key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    assert history("tau_at_budget") == [
        (b, meaningful("tau", t)) for b, t in enumerate(document["budget_curve"]["tau"], 1)
    ]
    assert [step for step, _ in history("node_cost.verify_ms")] == [1, 2, 5]  # to the budget-4 tree (4 yields to 5)
    assert [step for step, _ in history("node_cost.draft_ms")] == [0]
    prediction = document["prediction"]
    speeds = [meaningful("tokens_per_s", v) for v in prediction["tokens_per_s"]]
    assert history("predicted_tokens_per_s") == list(zip([1, 2, 3, 4], speeds, strict=True))
    metrics = client.get_run(run_id).data.metrics
    if not prediction["cannot_tell"] and not prediction["no_single"]:  # one budget named
        assert metrics["best.predicted_budget"] == prediction["best_budget"]
    assert history("tree_memory_mb") == [(b, meaningful("_mb", v)) for b, v in
                                         zip([1, 2, 3, 4], prediction["tree_memory_mb"], strict=True)]  # fmt: skip
    assert [step for step, _ in history("prediction_error")] == [0, 4]  # AR's check, then the decoded budget
    assert not any(key.startswith("tau_at_budget_error") for key in metrics)  # one budget: nothing to check
