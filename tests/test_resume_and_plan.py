"""A sweep run again: which earlier run may stand for a job (its settings digest, checked against the run's own
params), the parent's record of reused jobs; and the sweep's plan and GPU-time estimate."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from mlflow.entities import Param, RunTag
from mlflow.tracking import MlflowClient

from orchestrator.sweep.membership import Sweep
from orchestrator.sweep.plan import gpu_time, job_decodes, make_plan, progress_line
from orchestrator.sweep.resume import (
    HandedPhase1,
    Phase1Lookup,
    find_finished,
    find_phase_1,
    reused_jobs,
    reused_tag,
    why_not,
)
from orchestrator.tracking import tags
from orchestrator.tracking.settings_digest import PROMPTS_DIGEST, config_hash, settings_params
from orchestrator.tracking.signing import (
    KEY_FILE,
    KeyUnavailable,
    phase_1_problem,
    phase_1_signature,
    sign_run,
    signing_key,
)
from remote_worker.decoding.two_phase import PHASE_1_FILE
from tests.conftest import MlflowServer
from tests.paper_mirror import build_mirror

RESOLVED = {
    "experiment": {"name": "ddtree_gdn", "prompts": "gsm8k", "datasets_dir": "/a", "num_prompts": 2, "shard": None},
    "model": {"name": "tiny_trained", "dtype": "float32"},
    "decode": {"temperature": 0.0, "tree_budgets": [64, 1024], "max_new_tokens": 2048},
    "probe": {"tree_size": 8},
    "seed": 0,
    "host": {"name": "kpro5", "env": {"HF_TOKEN": "hf_x"}},
    "tracking": {"uri": "http://a"},
}


def test_the_digest_covers_what_decides_the_figures_and_nothing_else() -> None:
    base = settings_params(RESOLVED, "prompts text")
    assert base["decode.tree_budgets"] == "[64, 1024]" and base[PROMPTS_DIGEST] != "none"
    assert not any(k.startswith(("host.", "tracking.")) for k in base) and "experiment.datasets_dir" not in base
    moved = {**RESOLVED, "experiment": {**RESOLVED["experiment"], "datasets_dir": "/b"}, "host": {"name": "other"}}
    assert config_hash(settings_params(moved, "prompts text")) == config_hash(base)  # where from: not the figures
    for changed in (
        {**RESOLVED, "seed": 1},
        {**RESOLVED, "decode": {**RESOLVED["decode"], "temperature": 1.0}},
        {**RESOLVED, "experiment": {**RESOLVED["experiment"], "shard": "0/2"}},
    ):
        assert config_hash(settings_params(changed, "prompts text")) != config_hash(base)
    assert config_hash(settings_params(RESOLVED, "other prompts")) != config_hash(base)
    assert config_hash(dict(reversed(list(base.items())))) == config_hash(base)


@pytest.fixture
def client(mlflow_server: MlflowServer) -> MlflowClient:
    """The test process's real `mlflow server` (each test in experiments of its own): what a forger reaches."""
    return MlflowClient(tracking_uri=mlflow_server.uri)


def new_experiment(client: MlflowClient) -> str:
    return client.create_experiment(f"e-{uuid.uuid4().hex}")


def job_run(
    client: MlflowClient, experiment: str, params: dict[str, str], status: str = "FINISHED", **extra: str
) -> str:
    run = client.create_run(experiment, tags={tags.CONFIG_HASH: config_hash(params), **extra})
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


KEY = b"k" * 32


def test_a_run_is_reused_only_when_its_own_params_hold_the_settings_and_it_is_signed(
    client: MlflowClient, tmp_path: Path
) -> None:
    experiment = new_experiment(client)
    wanted = settings_params(RESOLVED, "text")
    assert find_finished(client, experiment, wanted, KEY).found is None
    job_run(client, experiment, wanted, status="FAILED")
    job_run(client, experiment, wanted, **{tags.SCOPE: "ar"})  # a method's run, not a job's
    forged = client.create_run(experiment, tags={tags.CONFIG_HASH: config_hash(wanted)})  # the tag alone
    client.log_batch(forged.info.run_id, params=[Param(k, "x") for k in wanted])
    client.set_terminated(forged.info.run_id, "FINISHED")
    assert find_finished(client, experiment, wanted, KEY).found is None
    assert why_not(client.get_run(forged.info.run_id), wanted, client, KEY).startswith("its params differ (")
    whole_forgery = job_run(client, experiment, wanted)  # params matching value for value, but never signed
    lookup = find_finished(client, experiment, wanted, KEY)
    assert lookup.found is None
    assert lookup.refused == f"run {whole_forgery}: it carries no signature of this user's orchestrator"
    good = job_run(client, experiment, wanted)
    (tmp_path / "generations.jsonl").write_text('{"id": "a"}\n')
    client.log_artifact(good, str(tmp_path / "generations.jsonl"))
    sign_run(client, good, KEY)
    found = find_finished(client, experiment, wanted, KEY).found
    assert found is not None and found.run_id == good
    assert find_finished(client, experiment, wanted, b"o" * 32).found is None  # another user's key
    other = settings_params({**RESOLVED, "seed": 3}, "text")
    assert find_finished(client, experiment, other, KEY).found is None
    # the signature covers the files the figures come from: one changed after signing is refused
    (tmp_path / "generations.jsonl").write_text('{"id": "b"}\n')
    client.log_artifact(good, str(tmp_path / "generations.jsonl"))
    assert "does not verify" in (why_not(client.get_run(good), wanted, client, KEY) or "")
    # and a signature copied onto another run does not verify there
    copy = job_run(client, experiment, wanted, **{tags.SIGNATURE: client.get_run(good).data.tags[tags.SIGNATURE]})
    assert "does not verify" in (why_not(client.get_run(copy), wanted, client, KEY) or "")


def test_a_phase_one_is_handed_on_only_from_a_stopped_job_run_of_these_settings_signed_over_its_bytes(
    client: MlflowClient, tmp_path: Path
) -> None:
    """A two-phase job that stopped in phase 2 left its phase 1 (`phase_1.json`), signed as it was received;
    the job's next run goes on from it only where everything a forger could set checks out."""
    experiment = new_experiment(client)
    wanted = settings_params(RESOLVED, "text")
    digest = config_hash(wanted)

    def stopped_run(status: str, data: bytes, signed_as: bytes | None = None, params: dict | None = None) -> str:
        run_id = job_run(client, experiment, params or wanted, status=status)
        (tmp_path / PHASE_1_FILE).write_bytes(data)
        client.log_artifact(run_id, str(tmp_path / PHASE_1_FILE))
        if signed_as is not None:
            client.set_tag(run_id, tags.PHASE_1_SIGNATURE, phase_1_signature(KEY, run_id, digest, signed_as))
        return run_id

    assert find_phase_1(client, experiment, wanted, KEY) == Phase1Lookup(None)
    stopped_run("KILLED", b"unsigned")  # never signed: not a candidate
    good = stopped_run("KILLED", b"phase 1", signed_as=b"phase 1")
    lookup = find_phase_1(client, experiment, wanted, KEY)
    assert lookup == Phase1Lookup(HandedPhase1(good, "KILLED", b"phase 1"))
    # newer candidates that do not check out are said (the newest first) and passed over
    swapped = stopped_run("FAILED", b"planted", signed_as=b"phase 1")  # the file replaced after signing
    copied = job_run(client, experiment, wanted, status="KILLED",
                     **{tags.PHASE_1_SIGNATURE: client.get_run(good).data.tags[tags.PHASE_1_SIGNATURE]})  # fmt: skip
    stopped_run("FINISHED", b"phase 1", signed_as=b"phase 1")  # FINISHED is find_finished's, not this
    running = job_run(client, experiment, wanted, status="RUNNING")
    client.set_tag(running, tags.PHASE_1_SIGNATURE, "x")  # still decoding: never taken from under it
    lookup = find_phase_1(client, experiment, wanted, KEY)
    assert lookup.found == HandedPhase1(good, "KILLED", b"phase 1")
    assert lookup.refused == f"run {copied}: its phase 1 cannot be read"
    assert phase_1_problem(client.get_run(swapped), digest, b"planted", KEY) == (
        "its phase 1's signature does not verify (made with another key, or the file changed since)"
    )
    assert find_phase_1(client, experiment, wanted, b"o" * 32).found is None  # another user's key
    assert find_phase_1(client, experiment, settings_params({**RESOLVED, "seed": 3}, "text"), KEY).found is None


def test_the_signing_key_is_made_once_private_and_a_shared_one_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    key = signing_key(state)
    assert len(key) == 32 and signing_key(state) == key
    assert (state / KEY_FILE).stat().st_mode & 0o777 == 0o600
    (state / KEY_FILE).chmod(0o644)
    with pytest.raises(KeyUnavailable, match="is not a private 32-byte key; remove it"):
        signing_key(state)


def test_the_parents_record_of_reused_jobs_is_read_as_numbers_and_ids(client: MlflowClient) -> None:
    experiment = new_experiment(client)
    parent = client.create_run(experiment)
    client.log_batch(
        parent.info.run_id,
        tags=[RunTag(reused_tag(3), "abc123"), RunTag(reused_tag(4), "x;rm -rf"), RunTag("sweep.reused.x", "a")],
    )
    assert reused_jobs(client.get_run(parent.info.run_id)) == {3: "abc123"}


@pytest.mark.usefixtures("datasets_cache")
def test_the_plan_counts_each_jobs_records_from_its_prompt_set(tmp_path: Path) -> None:
    mirror = build_mirror(tmp_path / "datasets", rows_per_set=3)
    base = {"experiment": {"prompts": None, "datasets_dir": str(mirror), "num_prompts": 2, "shard": None},
            "decode": {"tree_budgets": [64, 1024], "repeats": 1}}  # fmt: skip
    jobs = [
        {"experiment.prompts": "gsm8k", "decode.temperature": "0"},
        {"experiment.prompts": "mt-bench", "decode.temperature": "1"},
        {"experiment.prompts": "mt-bench", "experiment.shard": "1/2", "decode.tree_budgets": "[4,8,16]"},
        {"experiment.prompts": "nope"},
    ]
    plan = make_plan(base, jobs[:3])
    assert plan.records == [2, 4, 2] and plan.job_decodes == [8, 16, 10]
    assert plan.line() == "plan: 3 jobs · 8 records · 34 decodes (a method over a record)"
    # Two phases: every 4th record (at least 16, all of a smaller set) by AR, DFlash and the largest budget, then
    # DFlash and the chosen budget on every record
    assert job_decodes([1] * 64, {"protocol": "two_phase", "sample_every": 4}) == 2 * 64 + 2 * 16
    assert job_decodes([1] * 10, {"protocol": "two_phase", "sample_every": 4, "repeats": 2}) == (20 + 20) * 2
    assert job_decodes([2, 1, 1], {"tree_budgets": [64, 1024]}) == 4 * 4
    unknown = make_plan(base, jobs)
    assert unknown.records[3] is None and unknown.decodes is None and "not known here" in unknown.line()


def test_an_all_failed_sweep_is_not_done(client: MlflowClient) -> None:
    """Twenty jobs that failed in the worker are twenty failed jobs, with no time per record (none decoded)."""
    experiment = new_experiment(client)
    parent = client.create_run(experiment).info.run_id
    now = int(time.time() * 1000)
    for job in range(20):
        run = client.create_run(experiment, start_time=now, tags={tags.PARENT_RUN_ID: parent, tags.SWEEP_JOB: str(job)})
        client.set_terminated(run.info.run_id, "FAILED", end_time=now + 9000)
    assert progress_line(client, parent, [8] * 20, {}) == "plan: 0/20 jobs done (20 failed) in 3.0 GPU-min"


def test_the_estimate_is_the_time_per_record_so_far_times_the_records_left(client: MlflowClient) -> None:
    experiment = new_experiment(client)
    parent = client.create_run(experiment).info.run_id
    now = int(time.time() * 1000)
    for job, seconds in ((0, 20), (1, 40)):  # 60 s over 2 + 4 records: 10 s a record
        run = client.create_run(experiment, start_time=now, tags={tags.PARENT_RUN_ID: parent, tags.SWEEP_JOB: str(job)})
        client.set_terminated(run.info.run_id, "FINISHED", end_time=now + seconds * 1000)
    running = client.create_run(experiment, start_time=now, tags={tags.PARENT_RUN_ID: parent, tags.SWEEP_JOB: "2"})
    client.set_tag(parent, reused_tag(3), "abc")
    noted = {3: "abc"}  # the job's own note that it took run abc (`Sweep.note_reused`)
    line = progress_line(client, parent, [2, 4, 30, 100], noted)
    assert running.info.end_time is None
    assert line == "plan: 3/4 jobs done (1 reused) in 60 GPU-s · about 5.0 GPU-min left (10.0 s a record)"
    client.set_terminated(running.info.run_id, "FINISHED", end_time=now + 300 * 1000)  # 360 s over 36 records
    assert (
        progress_line(client, parent, [2, 4, 30, 100], noted)
        == "plan: 4/4 jobs done (1 reused) in 6.0 GPU-min (10.0 s a record)"
    )
    failed = client.create_run(experiment, start_time=now, tags={tags.PARENT_RUN_ID: parent, tags.SWEEP_JOB: "4"})
    client.set_terminated(failed.info.run_id, "FAILED", end_time=now + 40 * 1000)  # no record: not in the pace
    assert (
        progress_line(client, parent, [2, 4, 30, 100, 7], noted)
        == "plan: 4/5 jobs done (1 reused, 1 failed) in 6.7 GPU-min (10.0 s a record)"
    )
    assert gpu_time(59) == "59 GPU-s" and gpu_time(600) == "10.0 GPU-min" and gpu_time(36000) == "10.0 GPU-h"


def test_a_forged_reused_tag_on_a_sweeps_parent_is_a_refused_row_never_the_sweeps_figures(
    client: MlflowClient, tmp_path: Path
) -> None:
    """`sweep.reused.<job>` is a claim anyone may write on the parent: the run it names is read only when it is a
    signed job run of the sweep's own experiment; anything else is a REFUSED row, and the sweep stays FINISHED."""
    from orchestrator.sweep.rows import REFUSED, sweep_rows
    from orchestrator.sweep.summary import sweep_status

    experiment, elsewhere = new_experiment(client), new_experiment(client)
    wanted = settings_params(RESOLVED, "text")
    parent = client.create_run(experiment).info.run_id
    mine = job_run(client, experiment, wanted, **{tags.PARENT_RUN_ID: parent, tags.SWEEP_JOB: "0"})
    signed = job_run(client, experiment, wanted)
    sign_run(client, signed, KEY)
    unsigned = job_run(client, experiment, wanted)
    foreign = job_run(client, elsewhere, wanted)
    sign_run(client, foreign, KEY)
    for job, run_id in ((1, signed), (2, unsigned), (3, foreign)):
        client.set_tag(parent, reused_tag(job), run_id)
    rows = {row.job: row for row in sweep_rows(client, parent, KEY)}
    assert rows[0].run_id == mine and rows[1].run_id == signed and rows[1].reused
    assert rows[2].status == REFUSED and "it carries no signature" in rows[2].error
    assert rows[3].status == REFUSED and "is in another experiment" in rows[3].error
    assert sweep_status(list(rows.values())) == "FINISHED"
    assert all(row.status == REFUSED for row in sweep_rows(client, parent, None) if row.job > 0)
    # The progress line each job prints counts a reused job only where its tag names the run the job noted
    # taking in the sweep's own folder (job 1 here); tags no job of the sweep wrote count as refused.
    sweep = Sweep(tmp_path, parent, 1, fail_fast=False)
    sweep.note_reused(signed)
    Sweep(tmp_path, "another-parent", 2, fail_fast=False).note_reused(unsigned)  # another sweep's note
    assert sweep.reused_here() == {1: signed}
    assert progress_line(client, parent, [2] * 4, sweep.reused_here()).startswith(
        "plan: 2/4 jobs done (1 reused, 2 reused runs refused) in 0 GPU-s · about 0 GPU-s left"
    )
    client.set_tag(parent, reused_tag(1), unsigned)  # the tag rewritten to name another run: refused too
    assert progress_line(client, parent, [2] * 4, sweep.reused_here()).startswith(
        "plan: 1/4 jobs done (3 reused runs refused)"
    )
