"""At temperature > 0, DDTree's output follows the target's distribution, not the drafter's.

The joint distribution of the first two generated tokens of a tiny hybrid model with an 8-token vocabulary
is computed exactly from the model, then compared with DDTree samples by Pearson's chi-square test
(cells with an expected count under 5 merged, rejection at p < 1e-4). The drafter is deliberately biased;
the same test run on a loop that commits the drafter's token instead of the target's must reject.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chi2

import remote_worker.decoding.loop as loop
from remote_worker.cache.tree import Tree
from remote_worker.decoding.loop import decode
from remote_worker.models.loading import load_model
from remote_worker.models.target import TargetModel
from tests.tiny_models import model_spec

pytestmark = pytest.mark.worker  # also run under the oldest supported transformers (make test-compat)

VOCAB = 8
TEMPERATURE = 1.0
SAMPLES = 2000
PROMPT = torch.tensor([1, 5, 2, 6, 3])


class BiasedContext:
    def clone(self) -> BiasedContext:
        return self

    def reserve(self, needed: int) -> None: ...


class BiasedDrafter:
    """Proposes tokens 0, 1, 2, … in that order of preference at every depth, whatever the target thinks."""

    block_size = 4
    mask_token_id = VOCAB - 1
    feature_layers = ()

    def new_context(self) -> BiasedContext:
        return BiasedContext()

    def extend(self, context: BiasedContext, features: torch.Tensor) -> None: ...

    def propose(
        self, context: BiasedContext, root_embedding: torch.Tensor, mask_embedding: torch.Tensor, head: object
    ) -> torch.Tensor:
        preference = -torch.arange(VOCAB, dtype=torch.float64) * 2.0
        return torch.log_softmax(preference, dim=-1).expand(self.block_size - 1, VOCAB).clone()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    spec = model_spec("tiny_hybrid", "float64")
    config = dict(spec.config, vocab_size=VOCAB, initializer_range=0.4)
    return TargetModel(load_model(dataclasses.replace(spec, config=config), seed=1))


def exact_joint(target: TargetModel) -> torch.Tensor:
    """p(a, b) = p(a | prompt) p(b | prompt, a) at TEMPERATURE."""

    def next_probs(tokens: torch.Tensor) -> torch.Tensor:
        cache = target.new_cache()
        target.prefill(cache, tokens[:-1])
        logits = target.verify(cache, Tree.chain(tokens[-1:])).logits[-1]
        return torch.softmax(logits.double() / TEMPERATURE, dim=-1)

    first = next_probs(PROMPT)
    return torch.stack([first[a] * next_probs(torch.cat([PROMPT, torch.tensor([a])])) for a in range(VOCAB)])


def sampled_joint(target: TargetModel, method: str) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    accepted = 0
    generator = torch.Generator().manual_seed(1234)
    drafter = BiasedDrafter()
    for _ in range(SAMPLES):
        out = decode(
            target,
            PROMPT,
            method=method,
            max_new_tokens=2,
            drafter=drafter,
            budget=12,
            temperature=TEMPERATURE,
            generator=generator,
        )
        counts[out.tokens[0], out.tokens[1]] += 1
        accepted += out.acceptance_lengths[0]
    if method == "ddtree":  # the tree must really be used, or DDTree would be AR by another name
        assert accepted > SAMPLES // 2
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten()
    order = torch.argsort(expected)
    merged_expected, merged_observed, run_e, run_o = [], [], 0.0, 0.0
    for index in order.tolist():  # merge the smallest cells until each has an expected count of at least 5
        run_e += expected[index].item()
        run_o += observed[index].item()
        if run_e >= 5:
            merged_expected.append(run_e)
            merged_observed.append(run_o)
            run_e = run_o = 0.0
    if run_e > 0:
        merged_expected[-1] += run_e
        merged_observed[-1] += run_o
    e, o = torch.tensor(merged_expected), torch.tensor(merged_observed)
    statistic = float(((o - e) ** 2 / e).sum())
    return float(chi2.sf(statistic, df=len(merged_expected) - 1))


def test_the_target_distribution_is_not_uniform(target: TargetModel) -> None:
    """Otherwise the test below could not tell a biased loop from a correct one."""
    joint = exact_joint(target)
    assert joint.max() > 3 * joint.min()
    assert joint[0, 0] < 0.5


def sampled_joint_fixed(target: TargetModel, compiled: bool) -> torch.Tensor:
    """The same with the fixed-shape DDTree round (draws on the device, `choose_on_device`), compiled or
    eager, and a DFlash drafter with random weights (its own, arbitrary preferences)."""
    import copy

    from remote_worker.decoding.fixed_round import FixedRound
    from remote_worker.decoding.loop import decode_from, fixed_capacity, prefill
    from remote_worker.models.dflash import build_draft

    config = copy.deepcopy(model_spec("tiny_hybrid", "float64").draft.config)
    config.update(vocab_size=VOCAB, block_size=4, initializer_range=0.002)  # near-uniform drafts: wide trees
    config["dflash_config"].update(mask_token_id=VOCAB - 1)
    drafter = build_draft(config, 2, torch.float64, torch.device("cpu"))
    rounds = FixedRound(target, "ddtree", fixed_capacity(len(PROMPT), 2, 4, 12), drafter=drafter, budget=12,
                        temperature=TEMPERATURE)  # fmt: skip
    if compiled:
        torch._dynamo.reset()
        rounds.compile()
    start = prefill(target, PROMPT, drafter)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    accepted = 0
    generator = torch.Generator().manual_seed(1234)
    for _ in range(SAMPLES):
        out = decode_from(target, start, method="ddtree", max_new_tokens=2, drafter=drafter, budget=12,
                          temperature=TEMPERATURE, generator=generator, rounds=rounds)  # fmt: skip
        counts[out.tokens[0], out.tokens[1]] += 1
        accepted += out.acceptance_lengths[0]
    assert accepted > SAMPLES // 2  # the tree is really used
    return counts


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_fixed_shape_rounds_samples_follow_the_target(target: TargetModel, compiled: bool) -> None:
    """At T = 1 the fixed-shape DDTree round, eager and compiled, samples the target's distribution."""
    assert chi_square_p_value(sampled_joint_fixed(target, compiled), exact_joint(target)) > 1e-4


def test_ddtree_samples_follow_the_target(target: TargetModel) -> None:
    assert chi_square_p_value(sampled_joint(target, "ddtree"), exact_joint(target)) > 1e-4


def test_ar_samples_follow_the_target(target: TargetModel) -> None:
    assert chi_square_p_value(sampled_joint(target, "ar"), exact_joint(target)) > 1e-4


def test_the_test_rejects_a_loop_that_commits_the_drafters_token(
    target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def follow_the_draft(draft, targets):  # the bug: walk the drafter's best child, ignoring the target
        path = [0]
        while draft.children[path[-1]]:
            path.append(min(draft.children[path[-1]].values()))
        return path

    monkeypatch.setattr(loop, "walk", follow_the_draft)
    assert chi_square_p_value(sampled_joint(target, "ddtree"), exact_joint(target)) < 1e-4
