"""The trained tiny pairs: small, loaded like real checkpoints, lossless, and drafting for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remote_worker.decoding.loop import decode
from remote_worker.models.loading import PACKAGE_DIR, load_drafter, load_model, load_tokenizer, model_prompts
from remote_worker.models.target import TargetModel
from remote_worker.prompt_set import load_prompt_file
from remote_worker.prompts import encode
from tests.tiny_models import model_spec
from training.corpus import stdlib_files

PAIRS = ("tiny_trained", "tiny_trained_dense")
FIXTURES = PACKAGE_DIR / "fixtures"


def test_the_fixtures_are_small() -> None:
    size = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert 0 < size <= 10 * 1024 * 1024


@pytest.fixture(scope="module", params=PAIRS)
def pair(request: pytest.FixtureRequest):
    spec = model_spec(request.param, "float32")
    model = load_model(spec, seed=0)
    tokenizer = load_tokenizer(spec)
    prompts = load_prompt_file(Path(model_prompts(spec)))
    return request.param, TargetModel(model), load_drafter(spec, seed=0, target=model), tokenizer, prompts


def test_loaded_through_from_pretrained_with_tokenizer_and_held_out_prompts(pair) -> None:
    name, target, drafter, tokenizer, prompts = pair
    assert type(target.model).__name__ == ("Qwen3_5ForCausalLM" if name == "tiny_trained" else "Qwen3ForCausalLM")
    text = "def f(x):\n    return x\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert drafter.mask_token_id == tokenizer.mask_token_id
    held_out = {path.stem for path in stdlib_files(held_out=True)}
    assert len(prompts) == 8
    assert all(p.id.split("-")[1] in held_out for p in prompts), "prompts come from files the training never saw"
    lines = (FIXTURES / name / "target" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [p.id for p in prompts]


def _decode_all(target: TargetModel, drafter, tokenizer, prompts, method: str, budget: int = 0):
    outputs, lengths = [], []
    for prompt in prompts:
        ids = encode(prompt, tokenizer, target.embed.num_embeddings)
        result = decode(target, ids, method=method, max_new_tokens=48, drafter=drafter, budget=budget)
        outputs.append(result.tokens)
        lengths += result.acceptance_lengths
    return outputs, sum(a + 1 for a in lengths) / len(lengths)


def test_lossless_and_drafting_for_real_on_held_out_prompts(pair) -> None:
    """At temperature 0 every method emits AR's tokens; DFlash accepts well over one token a round, and a
    DDTree of 32 nodes more than the DFlash chain."""
    name, target, drafter, tokenizer, prompts = pair
    torch.manual_seed(0)
    ar, _ = _decode_all(target, None, tokenizer, prompts, "ar")
    dflash, dflash_tau = _decode_all(target, drafter, tokenizer, prompts, "dflash")
    ddtree, ddtree_tau = _decode_all(target, drafter, tokenizer, prompts, "ddtree", budget=32)
    assert dflash == ar and ddtree == ar
    assert dflash_tau > 1.5, (name, dflash_tau)
    assert ddtree_tau > 1.1 * dflash_tau, (name, dflash_tau, ddtree_tau)
