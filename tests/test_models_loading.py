"""Target classes beyond the causal LMs, and the DFlash drafter loaded from a checkpoint directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from remote_worker.cache.tree import Tree
from remote_worker.decoding.loop import decode
from remote_worker.models.dflash import build_draft, load_draft
from remote_worker.models.loading import (
    CheckpointCorrupt,
    CheckpointTooLarge,
    check_fits,
    checkpoint_bytes,
    load_model,
)
from remote_worker.models.target import TargetModel
from remote_worker.spec import ModelSpec
from tests.teacher_drafter import TeacherDrafter
from tests.tiny_models import random_prompt, tiny

# worker: only the worker's dependencies; compat: it touches transformers, so `make test-compat` runs it
# under the oldest supported release too
pytestmark = [pytest.mark.worker, pytest.mark.compat]

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


@pytest.fixture(scope="module")
def multimodal() -> TargetModel:
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=TEXT, vision_config=VISION)
    return TargetModel(Qwen3_5ForConditionalGeneration(config).to(torch.float64).eval())


def test_multimodal_class_used_text_only_matches_its_own_forward(multimodal: TargetModel) -> None:
    tokens = random_prompt(2).repeat(3)
    with torch.no_grad():
        reference = multimodal.model(input_ids=tokens[None]).logits[0].double()
    cache = multimodal.new_cache()
    logits = multimodal.verify(cache, Tree.chain(tokens)).logits.double()
    assert (logits - reference).abs().max() < 1e-6  # the model's own GDN kernel runs in float32
    assert multimodal.kinds == ("gdn", "gdn", "gdn", "attention")


def test_multimodal_class_decodes_losslessly(multimodal: TargetModel) -> None:
    for seed in range(5):
        prompt = random_prompt(seed)
        ar = decode(multimodal, prompt, method="ar", max_new_tokens=16)
        teacher = TeacherDrafter(prompt.tolist() + ar.tokens, 512, 8, seed)
        for budget in (4, 64):
            tree = decode(multimodal, prompt, method="ddtree", max_new_tokens=16, drafter=teacher, budget=budget)
            assert tree.tokens == ar.tokens


def draft_config(**extra: object) -> dict:
    return dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        block_size=8,
        dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 511},
        **extra,
    )


def proposals(target: TargetModel, draft, prompt: torch.Tensor) -> torch.Tensor:
    cache = target.new_cache()
    features = target.prefill(cache, prompt[:-1], draft.feature_layers)
    context = draft.new_context()
    draft.extend(context, features)
    mask = target.embed(torch.tensor(draft.mask_token_id))
    return draft.propose(context, target.embed(prompt[-1]), mask, target.head)


def save_checkpoint(draft, config: dict, folder: Path) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], **config}))
    state = {k: v.contiguous() for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
    save_file(state, folder / "model.safetensors")


def test_draft_loads_from_a_checkpoint_directory(tmp_path: Path) -> None:
    target, _ = tiny("tiny_hybrid")
    config = draft_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    built = build_draft(config, seed=3, dtype=torch.float32, device=torch.device("cpu"))
    save_checkpoint(built, config, tmp_path / "draft")
    loaded = load_draft(tmp_path / "draft", torch.float32, torch.device("cpu"))
    assert loaded.block_size == 8 and loaded.target_layer_ids == (0, 2) and loaded.mask_token_id == 511
    prompt = random_prompt(4)
    assert torch.equal(proposals(target, loaded, prompt), proposals(target, built, prompt))
    plain = build_draft(draft_config(), seed=3, dtype=torch.float32, device=torch.device("cpu"))
    assert not torch.allclose(proposals(target, plain, prompt), proposals(target, built, prompt)), "rope scaling used"


def test_draft_directory_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        load_draft(tmp_path, torch.float32, torch.device("cpu"))
    (tmp_path / "config.json").write_text(json.dumps(draft_config()))
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors"):
        load_draft(tmp_path, torch.float32, torch.device("cpu"))


def test_text_only_class_loads_a_multimodal_checkpoint_with_the_same_logits(
    multimodal: TargetModel, tmp_path: Path
) -> None:
    """Qwen3.6 checkpoints are saved by the multimodal class; the text-only class the 27B config names loads
    them without the vision tower, and decodes to the same logits."""
    multimodal.model.save_pretrained(tmp_path / "ckpt")
    spec = ModelSpec("mm", "pretrained", "Qwen3_5ForCausalLM", "float64", "cpu", {}, str(tmp_path / "ckpt"))
    text_only = load_model(spec, seed=0)
    assert type(text_only).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in name for name, _ in text_only.named_parameters())
    tokens = random_prompt(5)
    with torch.no_grad():
        expected = multimodal.model(input_ids=tokens[None]).logits
        got = text_only(input_ids=tokens[None]).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The size check counts what the text-only class loads: the vision tower is left out.
    full = checkpoint_bytes(tmp_path / "ckpt", torch.bfloat16, text_only=False)
    text = checkpoint_bytes(tmp_path / "ckpt", torch.bfloat16, text_only=True)
    parameters = sum(p.numel() for p in text_only.parameters()) * 2
    assert text < full and text == parameters, (text, full, parameters)


def test_a_checkpoint_too_big_for_the_gpu_is_one_line_before_any_weight_moves() -> None:
    with pytest.raises(CheckpointTooLarge) as err:
        check_fits(60 << 30, 40 << 30, torch.device("cuda", 0), "model qwen3_6_27b (/root/models/Qwen3.6-27B)")
    assert str(err.value) == (
        "model qwen3_6_27b (/root/models/Qwen3.6-27B): 60.0 GiB of weights do not fit the 40.0 GiB free on cuda:0"
    )
    check_fits(10, 11, torch.device("cuda", 0), "fits")


@pytest.mark.parametrize("damage", ["truncated shard", "garbage header", "bad config", "missing shard"])
def test_a_corrupt_checkpoint_names_the_file_and_its_directory(
    multimodal: TargetModel, tmp_path: Path, damage: str
) -> None:
    """An interrupted copy or a bad download: one line naming the file and the checkpoint directory, before
    transformers' own error (`MetadataIncompleteBuffer`, `Expecting value`) that names neither."""
    folder = tmp_path / "ckpt"
    multimodal.model.save_pretrained(folder)
    shard = folder / "model.safetensors"
    if damage == "truncated shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        expected = rf"model mm: model\.safetensors in {folder} is truncated \({len(data) // 2} bytes of {len(data)}\)"
    elif damage == "garbage header":
        shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"<html>not found!" + b"x" * 64)
        expected = rf"model mm: model\.safetensors in {folder} has an unreadable header"
    elif damage == "bad config":
        (folder / "config.json").write_text('{"architectures": ["Qwen3_5ForConditionalGeneration"],')
        expected = rf"model mm: config\.json in {folder} is not valid JSON \(Expecting"
    else:
        index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        expected = rf"model mm: model-00002-of-00002\.safetensors in {folder} is missing"
    spec = ModelSpec("mm", "pretrained", "Qwen3_5ForCausalLM", "float64", "cpu", {}, str(folder))
    with pytest.raises(CheckpointCorrupt, match=expected) as err:
        load_model(spec, seed=0)
    assert "\n" not in str(err.value) and str(err.value).endswith("; copy the checkpoint again")


def test_a_truncated_shard_is_the_runs_error_line_not_a_safetensors_message(tmp_path: Path) -> None:
    """What the researcher reads: the worker's end event (the run's `error` tag and the terminal's line) for
    an interrupted copy of the shipped trained pair's target."""
    from orchestrator import CONF_DIR
    from orchestrator.stream.events import split_events
    from remote_worker import runner
    from remote_worker.events import EVENTS_FILE
    from remote_worker.models.loading import checkpoint_dir

    folder = tmp_path / "target"
    shutil.copytree(checkpoint_dir("fixtures/tiny_trained/target"), folder)
    shard = folder / "model.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size - 1000])
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "tiny_trained.yaml"))
    model.update(path=str(folder), device="cpu")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = {"run_id": "t", "run_dir": str(run_dir), "seed": 0, "experiment": {"name": "ddtree_gdn"}, "model": model}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    assert runner.run(run_dir / "spec.json") == 1
    end = split_events((run_dir / EVENTS_FILE).read_bytes())[0][-1]
    assert end.kind == "end" and end.data == {
        "status": "FAILED",
        "error": f"remote_worker.models.loading.CheckpointCorrupt: model tiny_trained: model.safetensors in {folder} "
        f"is truncated ({size - 1000} bytes of {size}); copy the checkpoint again",
    }
