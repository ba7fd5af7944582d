"""`decode.protocol=two_phase`: phase 1 on a sample (AR, DFlash, DDTree at the largest budget), phase 2 on every
record (DFlash and DDTree at the budget phase 1 chose), exact at T = 0 against AR on the sample and against
DFlash elsewhere; the paper's figures merge the phases' rows and predict AR where it did not run."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest

from orchestrator.sweep.paper.ar_prediction import ar_times
from orchestrator.sweep.paper.figures import cell, read_records
from remote_worker import stop_signal
from remote_worker.decoding.two_phase import MIN_SAMPLE, Choice, choose_budget, sample_positions
from remote_worker.events import EventLog
from remote_worker.experiments import ddtree_gdn, phase_two
from remote_worker.experiments.ddtree_gdn import run_ddtree_gdn
from remote_worker.experiments.phase_one_state import PHASE_1_FILE
from remote_worker.experiments.phase_two import protocol_of
from remote_worker.experiments.record_loop import RecordLoop
from remote_worker.spec import parse_spec
from tests.specs import decode_spec
from tests.test_budget_answer import answer, costs

pytestmark = pytest.mark.worker

PROMPTS = 20  # more than MIN_SAMPLE, so that phase 2 has records of its own


def test_the_sample_is_every_kth_record_at_least_sixteen_or_the_whole_set() -> None:
    assert sample_positions(64, 4) == list(range(0, 64, 4))
    assert sample_positions(10, 4) == list(range(10))  # smaller than the minimum: the whole set
    spread = sample_positions(40, 4)  # every 4th would be 10: 16 spread over the set instead
    assert len(spread) == MIN_SAMPLE and spread[0] == 0 and spread[-1] < 40 and spread == sorted(set(spread))
    assert sample_positions(0, 4) == []
    with pytest.raises(ValueError, match="every=0"):
        sample_positions(10, 0)


@pytest.mark.parametrize(
    ("decode", "message"),
    [
        ({"protocol": "fast"}, "decode.protocol='fast' must be one of grid, two_phase"),
        ({"protocol": "two_phase", "sample_every": 0}, "decode.sample_every=0 must be a positive integer"),
        ({"protocol": "two_phase", "sample_every": True}, "decode.sample_every=True must be a positive integer"),
    ],
)
def test_a_bad_protocol_setting_is_one_line(decode: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        protocol_of(decode)


def test_the_budget_chosen_is_the_predictions_fastest_or_the_decoded_one_where_it_cannot_answer() -> None:
    told, ranged = answer(), answer(measured_2=600.0)
    assert choose_budget(told, 4) == Choice(3, "predicted fastest by phase 1")
    assert choose_budget(ranged, 4).budget == 3 and choose_budget(ranged, 4).why.startswith(
        "the fastest predicted of 3 budgets phase 1 cannot tell apart: 3 leads 2 by 5.0 %"
    )
    slower = answer(costs=costs([0.2, 4.0], [1, 5]), ar=1400.0)  # every budget slower than AR by the costs
    assert choose_budget(slower, 4).budget == slower.best_budget
    assert choose_budget(slower, 4).why.startswith("the fastest predicted by phase 1, though by its own costs no ")
    # Phase 1 decodes only the largest budget, slower than AR where a smaller one is predicted faster: the run's
    # drafting methods all measured slower than AR, and the choice is still the prediction's, not the largest
    disagree = answer(drafting_slower=True, measured_by="phase 1")
    assert choose_budget(disagree, 4) == Choice(
        3,
        "the fastest predicted by phase 1, though phase 1 measured every drafting method slower than AR, and its "
        "costs predict budget 3 at ×1.75: they disagree",
    )  # what phase 1 measured, not the run: the chosen budget, measured after, may well be faster than AR
    assert choose_budget(answer(run_kind="compiled"), 4) == Choice(
        4,
        "phase 1's prediction cannot answer, its costs are of eager rounds, and this run decoded compiled ones: "
        "the budget it decoded",
    )
    assert choose_budget(None, 4) == Choice(4, "no prediction from phase 1: the budget it decoded")


def scopes_speedup(summary: dict, scope: str) -> float:
    return next(m["speedup_vs_ar"] for m in summary["methods"] if m["scope"] == scope)


def decode_two_phases(tmp_path: Path, temperature: float, new: int = 6, **decode: object) -> tuple[list[dict], dict]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"def f{i}(x): return x *"}]}
               for i in range(PROMPTS)]  # fmt: skip
    (run_dir / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    raw = decode_spec(
        run_dir, num_prompts=None, max_new_tokens=new, tree_budgets=[8], temperature=temperature, compile=False,
        protocol="two_phase", sample_every=4, **decode,
    )  # fmt: skip
    raw["experiment"]["prompts_file"] = "prompts.jsonl"
    lines = run_ddtree_gdn(parse_spec(raw, run_dir), EventLog(run_dir))
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "decode_summary.json").read_text())
    return rows, {**summary, "lines": lines}


def test_two_phases_decode_what_the_table_needs_and_every_ddtree_output_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The budget phase 1 chooses, set by the test (a hook, not the tiny model's costs): one it did not decode
    monkeypatch.setattr(phase_two, "choose_budget", lambda prediction, largest: Choice(3, "the test's"))
    rows, summary = decode_two_phases(tmp_path, 0.0, node_costs=False)
    sample = {f"p{i}" for i in sample_positions(PROMPTS, 4)}
    assert len(sample) == MIN_SAMPLE
    first = [r for r in rows if r["phase"] == 1]
    second = [r for r in rows if r["phase"] == 2]
    assert {r["id"] for r in first} == sample
    assert all(set(r["methods"]) == {"ar", "dflash", "ddtree_tb8"} for r in first)
    assert [r["id"] for r in second] == [f"p{i}" for i in range(PROMPTS)]  # every record, in order
    for row in second:
        expected = {"ddtree_tb3"} if row["id"] in sample else {"dflash", "ddtree_tb3"}
        assert set(row["methods"]) == expected, row["id"]
    # Exact at T = 0: on the sample every method equals AR; elsewhere DDTree equals DFlash, and says so
    by_id = {r["id"]: r for r in first}
    for row in second:
        ddtree = row["methods"]["ddtree_tb3"]["tokens"]
        if row["id"] in sample:
            assert ddtree == by_id[row["id"]]["methods"]["ar"]["tokens"]
            assert row["methods"]["ddtree_tb3"]["matches_ar"] is True
        else:
            assert ddtree == row["methods"]["dflash"]["tokens"] and row["methods"]["ddtree_tb3"]["matches_dflash"]
            assert "matches_ar" not in row["methods"]["ddtree_tb3"]
    protocol = summary["protocol"]
    assert (protocol["chosen_budget"], protocol["sample_records"], protocol["records"]) == (3, MIN_SAMPLE, PROMPTS)
    assert protocol["compared"] == PROMPTS and protocol["matched"] == PROMPTS
    assert summary["lines"]["protocol"] == protocol["line"]
    assert "DDTree's tokens equal the exact reference's on 20 of 20" in protocol["line"]
    # the choice checked where it can be: the chosen budget measured on the sample, paired with AR
    assert protocol["sample_speedup"] == scopes_speedup(summary, "ddtree_tb3") and protocol["predicted_speedup"] is None
    assert f"on the sample it ran ×{protocol['sample_speedup']:.2f} vs AR;" in protocol["line"]
    # The run's own figures are the sample's, each method paired with AR on the same records
    scopes = {m["scope"]: m for m in summary["methods"]}
    assert set(scopes) == {"ar", "dflash", "ddtree_tb8", "ddtree_tb3"}
    assert all(m["prompts"] == MIN_SAMPLE for m in scopes.values())
    assert scopes["ddtree_tb3"]["lossless"] == 1.0
    # The paper's figures: the phases' rows merged, AR predicted on the records it did not decode
    records = read_records((tmp_path / "run" / "generations.jsonl").read_text().splitlines())
    assert len(records) == PROMPTS
    ar = ar_times(records)
    assert ar.predicted == PROMPTS - MIN_SAMPLE and ar.cost is not None and ar.check is not None
    figures = cell(records, "ddtree_tb3", 3, ar=ar.seconds_per_token)
    assert figures.records == PROMPTS and figures.speedup > 0


def test_two_phases_at_temperature_one_choose_from_the_prediction(tmp_path: Path) -> None:
    rows, summary = decode_two_phases(tmp_path, 1.0, new=16, node_cost_repeats=1)  # a round can hold a whole tree
    protocol = summary["protocol"]
    assert 1 <= protocol["chosen_budget"] <= 8 and protocol["compared"] == 0
    chosen = f"ddtree_tb{protocol['chosen_budget']}"
    phase_2 = [r for r in rows if r["phase"] == 2]
    assert all(chosen in r["methods"] for r in phase_2)
    # The sample's records decode the chosen budget again only where phase 1 did not decode it
    assert len(phase_2) == (PROMPTS - MIN_SAMPLE if chosen == "ddtree_tb8" else PROMPTS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["decode.protocol=fast"], "decode.protocol='fast' must be one of grid, two_phase"),
        (["decode.protocol='two\x1b[2Jphase'"], "decode.protocol='two\\x1b[2Jphase' must be one of grid, two_phase"),
        (["decode.sample_every=0"], "decode.sample_every=0 must be an integer >= 1"),
        (["decode.sample_every=2.5"], "decode.sample_every=2.5 must be an integer >= 1"),
    ],
)
def test_the_orchestrator_refuses_a_bad_protocol_in_one_line(overrides: list[str], message: str) -> None:
    from orchestrator.config.validation import ConfigError
    from tests.test_node_cost import composed

    assert composed(["decode.protocol=two_phase"])["decode"]["protocol"] == "two_phase"
    with pytest.raises(ConfigError) as err:
        composed(overrides)
    assert str(err.value) == message


def test_phase_twos_round_joins_the_compiled_rounds_at_their_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """`add_round`: the chosen budget's fixed-shape round built at the rounds' capacity beside phase 1's, warmed
    up, decoding AR's tokens; a compiler that fails leaves the others as they were and says why in one line.
    (torch.compile itself is left out, as a hook in the test: `test_compiled_rounds` compiles these rounds.)"""
    from remote_worker.decoding import compiled as compiled_module
    from remote_worker.decoding.comparison import methods_for
    from remote_worker.decoding.fixed_round import FixedRound
    from remote_worker.decoding.loop import decode, decode_from, prefill
    from tests.tiny_models import random_prompt, tiny

    monkeypatch.setattr(FixedRound, "compile", lambda self, mode=None: None)  # the rounds run as written
    monkeypatch.setattr(compiled_module.FixedPrefill, "compile", lambda self, mode=None: None)
    target, draft = tiny("tiny_hybrid", "float32")
    prompt = random_prompt(4)
    rounds = compiled_module.compile_rounds(target, draft, methods_for([16]), prompt, 16, 10)
    assert not isinstance(rounds, str) and set(rounds.rounds) == {"ar", "dflash", "ddtree_tb16"}
    chosen = methods_for([5])[-1]
    assert compiled_module.add_round(rounds, target, draft, chosen, prompt, 10) is None
    assert set(rounds.rounds) == {"ar", "dflash", "ddtree_tb16", "ddtree_tb5"} and rounds.recompiles() == 0
    assert rounds.rounds["ddtree_tb5"].capacity == rounds.rounds["ddtree_tb16"].capacity == rounds.capacity
    start = prefill(target, prompt, draft, rounds.prefiller)
    out = decode_from(target, start, method="ddtree", max_new_tokens=10, drafter=draft, budget=5,
                      rounds=rounds.rounds["ddtree_tb5"])  # fmt: skip
    assert out.tokens == decode(target, prompt, method="ar", max_new_tokens=10).tokens and out.fixed

    def broken(self: FixedRound, mode: str | None = None) -> None:
        raise RuntimeError("no compiler here\nsecond line")

    monkeypatch.setattr(FixedRound, "compile", broken)
    problem = compiled_module.add_round(rounds, target, draft, methods_for([7])[-1], prompt, 10)
    assert problem == "ddtree_tb7: RuntimeError: no compiler here" and "ddtree_tb7" not in rounds.rounds


def test_a_job_stopped_between_the_phases_resumes_with_phase_two_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped as phase 2 starts (the SIGTERM of a Ctrl-C or a preemption), a run leaves phase 1 whole in
    `phase_1.json`, listed as an artifact; the job's next run, handed that file, decodes no phase-1 method and
    ends with every row: phase 1's as they were, phase 2's exact. A file that does not fit is decoded again."""
    monkeypatch.setattr(phase_two, "choose_budget", lambda prediction, largest: Choice(3, "the test's"))
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"def f{i}(x): return x *"}],
                **({"followups": ["and for y?"]} if i % 8 == 0 else {})} for i in range(PROMPTS)]  # fmt: skip

    def run(name: str, handed: bytes | None = None) -> tuple[Path, dict[str, str]]:
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
        raw = decode_spec(run_dir, num_prompts=None, max_new_tokens=6, tree_budgets=[8], compile=False,
                          protocol="two_phase", sample_every=4, node_costs=False)  # fmt: skip
        raw["experiment"]["prompts_file"] = "prompts.jsonl"
        if handed is not None:
            (run_dir / PHASE_1_FILE).write_bytes(handed)
            raw["experiment"]["phase_1_file"] = PHASE_1_FILE
        return run_dir, run_ddtree_gdn(parse_spec(raw, run_dir), EventLog(run_dir))

    real_phase_2 = ddtree_gdn.run_phase_2

    def stopped(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(stop_signal, "_requested", signal.SIGTERM)  # the first decode of phase 2 stops
        return real_phase_2(*args, **kwargs)

    monkeypatch.setattr(ddtree_gdn, "run_phase_2", stopped)
    with pytest.raises(SystemExit):
        run("first")
    monkeypatch.setattr(stop_signal, "_requested", None)
    monkeypatch.setattr(ddtree_gdn, "run_phase_2", real_phase_2)
    first = tmp_path / "first"
    events = [json.loads(line) for line in (first / "events.jsonl").read_text().splitlines()]
    assert {"path": PHASE_1_FILE} in [e["data"] for e in events if e["kind"] == "artifact"]
    first_rows = (first / "generations.jsonl").read_text().splitlines()
    sample = sample_positions(PROMPTS, 4)
    records = sum(2 if i % 8 == 0 else 1 for i in sample)
    assert len(first_rows) == records and all(json.loads(r)["phase"] == 1 for r in first_rows)

    decoded: list[list[str]] = []
    real_decode = RecordLoop.decode

    def counting(self: RecordLoop, turn: object, methods: list, announce: object) -> object:
        decoded.append([m.scope for m in methods])
        return real_decode(self, turn, methods, announce)

    monkeypatch.setattr(RecordLoop, "decode", counting)
    second, lines = run("second", (first / PHASE_1_FILE).read_bytes())
    # Phase 2 alone: DFlash and DDTree 3 outside the sample, DDTree 3 on it; never AR or DDTree 8 again
    assert sorted(map(tuple, decoded)) == sorted(
        [("dflash", "ddtree_tb3")] * (PROMPTS + 3 - records) + [("ddtree_tb3",)] * records
    )
    rows = (second / "generations.jsonl").read_text().splitlines()
    assert rows[:records] == first_rows  # phase 1's rows, as the stopped run wrote them
    phase_2 = [json.loads(r) for r in rows[records:]]
    assert all(r["phase"] == 2 for r in phase_2) and len(phase_2) == PROMPTS + 3
    summary = json.loads((second / "decode_summary.json").read_text())
    protocol = summary["protocol"]
    assert protocol["restored"] is True and "(restored from a stopped run of these settings)" in lines["protocol"]
    assert protocol["compared"] == protocol["matched"] == PROMPTS + 3  # exact on every record
    assert {m["scope"]: m["prompts"] for m in summary["methods"]} == dict.fromkeys(
        ["ar", "dflash", "ddtree_tb8", "ddtree_tb3"], records
    )
    assert (second / PHASE_1_FILE).read_bytes() == (first / PHASE_1_FILE).read_bytes()  # kept for a next stop

    # A phase 1 that is not this run's sample is decoded again, with a warning saying why
    document = json.loads((first / PHASE_1_FILE).read_bytes())
    document["records"][3]["ids"][0] += 1
    decoded.clear()
    with caplog.at_level(logging.WARNING, logger="remote_worker.experiments.ddtree_gdn"):
        run("third", json.dumps(document).encode())
    assert ("ar", "dflash", "ddtree_tb8") in map(tuple, decoded)
    tampered = f"p{document['records'][3]['position']}"
    assert (
        f"phase 1 of an earlier run is not used, so it is decoded again: record '{tampered}': turn 1 encodes to "
        "other token ids than the ones phase 1 decoded" in caplog.text
    )
