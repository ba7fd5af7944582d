"""AR's time where it did not run (`sweep.paper.ar_prediction`): a step cost a + b·context fitted on the records
AR decoded, checked by leaving each out, and used for the records it did not decode."""

from __future__ import annotations

import pytest

from orchestrator.sweep.paper.ar_prediction import ArCost, ArSample, ar_times, context_sum, leave_one_out
from orchestrator.sweep.paper.figures import MethodRecord, Record

STEP, PER_CONTEXT = 2e-3, 1e-6  # 2 ms a step, 1 µs per token of context


def exact(prompt: int, output: int) -> ArSample:
    return ArSample(prompt, output, STEP * output + PER_CONTEXT * context_sum(prompt, output))


def test_the_context_sum_is_the_contexts_the_steps_read() -> None:
    assert context_sum(10, 3) == 10 + 11 + 12
    assert context_sum(5, 1) == 5 and context_sum(7, 0) == 0


def test_the_fit_recovers_the_step_cost_and_leaving_one_out_predicts_it_exactly() -> None:
    samples = [exact(p, n) for p, n in ((10, 50), (400, 20), (1500, 64), (30, 200), (800, 8))]
    fit = ArCost.fit(samples)
    # Least squares on exact data: the solution is the truth, up to the normal equations' rounding (their
    # entries reach 1e10; in float64 the solve loses at most ~1e-6 of the smaller parameter)
    assert fit.step_s == pytest.approx(STEP, rel=1e-6) and fit.per_context_s == pytest.approx(PER_CONTEXT, rel=1e-6)
    assert fit.records == 5
    assert fit.seconds_per_token(100, 10) == pytest.approx(STEP + PER_CONTEXT * (100 + 4.5), rel=1e-6)
    check = leave_one_out(samples)
    assert check.worst < 1e-6 and abs(check.total) < 1e-6 and len(check.per_record) == 5


def test_a_cache_that_makes_steps_cheaper_is_not_believed() -> None:
    """Times that fall with context (noise on a few records) would fit b < 0: the step cost alone instead."""
    samples = [ArSample(10, 10, 0.05), ArSample(1000, 10, 0.01), ArSample(500, 10, 0.03)]
    fit = ArCost.fit(samples)
    assert fit.per_context_s == 0 and fit.step_s == pytest.approx(0.09 / 30)


def test_too_few_records_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"^AR's step cost needs at least 3 records AR decoded, not 2$"):
        ArCost.fit([exact(10, 5), exact(20, 5), ArSample(30, 0, 0.0)])  # a record of no output counts for nothing
    with pytest.raises(ValueError, match=r"^checking AR's fit needs at least 4 records AR decoded, not 3$"):
        leave_one_out([exact(10, 5), exact(20, 5), exact(30, 5)])


def record(rid: str, prompt: int, ar: ArSample | None, dflash_tokens: int) -> Record:
    methods = {"dflash": MethodRecord(tuple(range(dflash_tokens)), 0.01, 2.0)}
    if ar is not None:
        methods["ar"] = MethodRecord(tuple(range(ar.output_tokens)), ar.decode_s, 1.0)
    return Record(rid, methods, prompt)


def test_ar_times_are_measured_where_ar_ran_and_predicted_from_dflashs_length_elsewhere() -> None:
    sampled = [record(f"s{i}", p, exact(p, n), n) for i, (p, n) in enumerate(((10, 50), (400, 20), (900, 30), (60, 9)))]
    others = [record("o0", 300, None, 40), record("o1", 20, None, 5)]
    times = ar_times([*sampled, *others])
    assert times.measured == [True] * 4 + [False] * 2 and times.predicted == 2
    assert times.seconds_per_token[:4] == [r.methods["ar"].seconds_per_token for r in sampled]
    assert times.seconds_per_token[4] == pytest.approx(exact(300, 40).decode_s / 40, rel=1e-6)
    assert times.check is not None and times.check.worst < 1e-6
    assert ar_times(sampled).cost is None  # AR decoded every record: nothing predicted
    with pytest.raises(ValueError, match="prompt length"):
        ar_times([*sampled, record("o2", 0, None, 5)])


@pytest.mark.worker
def test_the_fit_predicts_ar_decoded_on_held_out_records_of_the_tiny_pair() -> None:
    """Real AR decodes of the tiny hybrid at prompts of 8 to 600 tokens: the fit on every other record predicts
    the rest. Sample and held-out records alternate, so whatever slows the machine slows both; the bound, a
    factor of two on the held-out total, leaves room for a busy machine. (The bench checks the fit closer, on
    the trained pair's 112 held-out records: `bench.paper_protocol`.)"""
    import torch

    from remote_worker.decoding.loop import decode
    from tests.tiny_models import tiny

    torch.manual_seed(0)
    target, _ = tiny("tiny_hybrid", "float32")
    decode(target, torch.randint(0, 500, (8,)), method="ar", max_new_tokens=4)  # warm-up
    samples = []
    for length in (8, 600, 40, 450, 120, 300, 16, 520, 200, 80, 380, 60):
        prompt = torch.randint(0, 500, (length,))
        out = decode(target, prompt, method="ar", max_new_tokens=24)
        samples.append(ArSample(length, len(out.tokens), out.decode_seconds))
    fit = ArCost.fit(samples[0::2])
    held_out = samples[1::2]
    predicted = sum(fit.decode_s(s.prompt_tokens, s.output_tokens) for s in held_out)
    measured = sum(s.decode_s for s in held_out)
    assert 0.5 < predicted / measured < 2.0, (fit, predicted, measured)
