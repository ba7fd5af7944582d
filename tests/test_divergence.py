"""Divergences from AR are counted as near ties (rounding can explain them) or unexplained (a bug).

Two forced cases on a trained pair: a logit perturbed within the tolerance, so that tree verification
takes AR's runner-up at one position where AR's own margin is a near tie; and a loop that commits the
draft's token instead of the target's, whose divergences have wide margins.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import remote_worker.decoding.loop as loop
from remote_worker.cache.tree import Tree
from remote_worker.decoding.comparison import Comparison, Settings, methods_for, run_prompt
from remote_worker.decoding.divergence import NEAR_TIE_EPS, first_divergence, tie_tolerance
from remote_worker.models.loading import load_drafter, load_model, load_tokenizer, model_prompts
from remote_worker.models.target import TargetModel, VerifyOutput
from remote_worker.prompt_set import load_prompt_file
from remote_worker.prompts import encode
from tests.tiny_models import model_spec

pytestmark = pytest.mark.worker

NEW_TOKENS = 24


def test_tolerance_follows_the_dtype() -> None:
    assert tie_tolerance(torch.bfloat16, 20.0) == pytest.approx(NEAR_TIE_EPS * 2**-7 * 20)
    assert tie_tolerance(torch.float32, 0.1) == pytest.approx(NEAR_TIE_EPS * 2**-23)
    assert tie_tolerance(torch.float32, -30.0) < tie_tolerance(torch.bfloat16, -30.0) / 1000


def test_first_divergence_position_and_margin() -> None:
    margins = [(9.0, 1.0), (5.0, 4.99), (7.0, 2.0)]
    assert first_divergence([1, 2, 3], margins, [1, 2, 3], torch.bfloat16) is None
    tie = first_divergence([1, 2, 3], margins, [1, 5, 3], torch.bfloat16)
    assert (tie.position, tie.ar_token, tie.token) == (1, 2, 5) and tie.near_tie
    assert tie.gap == pytest.approx(0.01)
    wide = first_divergence([1, 2, 3], margins, [4, 2, 3], torch.bfloat16)
    assert wide.position == 0 and not wide.near_tie and wide.as_record()["kind"] == "unexplained"
    shorter = first_divergence([1, 2, 3], margins, [1, 2], torch.float32)
    assert (shorter.position, shorter.token) == (2, None)


class NearTieTarget(TargetModel):
    """Moves AR's runner-up at one generated position to one unit in the last place below the best logit, and
    for tree verification (any tree of more than one node) one unit above it: a flip of the size rounding
    could cause, so the tree takes the runner-up there."""

    def __init__(self, inner: TargetModel, prompt_length: int, position: int) -> None:
        self.__dict__.update(inner.__dict__)
        self.absolute = prompt_length - 1 + position  # the node whose logits choose generated token `position`

    def verify(self, cache, tree: Tree, hidden_layers=()) -> VerifyOutput:
        output = super().verify(cache, tree, hidden_layers)
        rows = (cache.length + tree.depths.to(output.logits.device)) == self.absolute
        if rows.any():
            logits = output.logits.clone()
            top = logits[rows].topk(2, dim=-1)
            best = top.values[:, 0]
            direction = torch.full_like(best, float("inf") if tree.size > 1 else float("-inf"))
            logits[rows.nonzero()[:, 0], top.indices[:, 1]] = torch.nextafter(best, direction)
            output = VerifyOutput(logits=logits, hidden=output.hidden)
        return output


@pytest.fixture(scope="module")
def trained():
    spec = model_spec("tiny_trained", "float32")
    model = load_model(spec, seed=0)
    target, drafter = TargetModel(model), load_drafter(spec, seed=0, target=model)
    prompts = load_prompt_file(Path(model_prompts(spec)), 2)
    ids = [encode(p, load_tokenizer(spec), target.embed.num_embeddings) for p in prompts]
    return target, drafter, ids


def test_a_flip_within_the_tolerance_is_a_near_tie(trained) -> None:
    target, drafter, ids = trained
    position = 5
    perturbed = NearTieTarget(target, ids[0].shape[0], position)
    comparison = Comparison(methods_for([16]), 0.0, torch.float32)
    run = run_prompt(perturbed, drafter, ids[0], comparison.methods, Settings(NEW_TOKENS), index=0)
    divergences = comparison.add(run)
    assert divergences["ar"] is None
    for scope in ("dflash", "ddtree_tb16"):
        divergence = divergences[scope]
        assert divergence is not None and divergence.position == position, scope
        assert 0 < divergence.gap <= divergence.tolerance and divergence.near_tie, scope
    metrics = comparison.metrics()
    assert metrics["dflash"]["lossless"] == 0.0
    assert metrics["dflash"]["near_tie_divergences"] == 1.0 and metrics["dflash"]["unexplained_divergences"] == 0.0


def test_a_loop_that_commits_the_drafts_token_is_unexplained(trained, monkeypatch: pytest.MonkeyPatch) -> None:
    target, drafter, ids = trained

    def follow_the_draft(draft, targets):  # the bug: walk the drafter's first child, ignoring the target
        path = [0]
        while draft.children[path[-1]]:
            path.append(min(draft.children[path[-1]].values()))
        return path

    comparison = Comparison(methods_for([16]), 0.0, torch.float32)
    monkeypatch.setattr(loop, "walk", follow_the_draft)  # AR's one-node trees walk the same either way
    for index, prompt in enumerate(ids):
        comparison.add(run_prompt(target, drafter, prompt, comparison.methods, Settings(NEW_TOKENS), index))
    metrics = comparison.metrics()
    for scope in ("dflash", "ddtree_tb16"):
        assert metrics[scope]["unexplained_divergences"] >= 1, scope
        assert metrics[scope]["near_tie_divergences"] == 0, scope
        assert metrics[scope]["lossless"] < 1
    assert metrics["ar"]["lossless"] == 1.0


def test_honest_decoding_has_no_divergence_in_float32(trained) -> None:
    target, drafter, ids = trained
    comparison = Comparison(methods_for([16, 64]), 0.0, torch.float32)
    for index, prompt in enumerate(ids):
        comparison.add(run_prompt(target, drafter, prompt, comparison.methods, Settings(NEW_TOKENS), index))
    for scope, metrics in comparison.metrics().items():
        assert metrics["lossless"] == 1.0, scope
        assert metrics["near_tie_divergences"] == metrics["unexplained_divergences"] == 0.0, scope
