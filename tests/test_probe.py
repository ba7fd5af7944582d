"""experiment=probe on the tiny models: what the cache does on a dense and on a hybrid (GDN) model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from orchestrator import CONF_DIR
from orchestrator.stream.events import split_events
from remote_worker.events import EVENTS_FILE, EventLog
from remote_worker.experiments.probe import PROBE_FILE, run_probe
from remote_worker.spec import parse_spec

pytestmark = pytest.mark.worker  # also run under the oldest supported transformers (make test-compat)


def probe_spec(run_dir: Path, model: str, dtype: str = "float32") -> dict:
    model_cfg = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml"))
    model_cfg["dtype"] = dtype
    model_cfg["device"] = "cpu"
    return {
        "run_id": "test",
        "run_dir": str(run_dir),
        "seed": 0,
        "experiment": {"name": "probe"},
        "model": model_cfg,
        "decode": {},
        "probe": {"prefill_tokens": 16, "crop_tokens": 4, "tree_size": 12},
    }


def run(tmp_path: Path, model: str, dtype: str = "float32") -> tuple[dict, dict, list]:
    spec = parse_spec(probe_spec(tmp_path, model, dtype), tmp_path)
    log = EventLog(tmp_path)
    summary = run_probe(spec, log)
    log.close()
    report = json.loads((tmp_path / PROBE_FILE).read_text())
    events, _ = split_events((tmp_path / EVENTS_FILE).read_bytes())
    return report, summary, events


def test_dense_model_crops_exactly(tmp_path: Path) -> None:
    report, summary, _ = run(tmp_path, "tiny_dense", dtype="float64")
    model, cache = report["model"], report["cache"]
    assert model["class"] == "Qwen3ForCausalLM"
    assert model["layer_type_counts"] == {"full_attention": 4}
    assert model["embedding_module"] == "model.embed_tokens" and model["head_module"] == "lm_head"
    assert model["hidden_states_per_layer_plus_embeddings"] is True and model["hidden_states_count"] == 5
    assert cache["prebuilt_from_config"] == "ok"
    assert cache["reports_croppable"] in (True, "not reported")  # releases before is_croppable say nothing
    assert cache["native_crop"]["result"] == "ok"
    assert cache["native_crop"]["seq_length_after_crop"] == 12
    assert cache["native_crop"]["logits_max_abs_diff"] < 1e-10
    assert summary["native crop"] == "ok"


def test_hybrid_model_cannot_be_rolled_back_by_crop(tmp_path: Path) -> None:
    report, summary, _ = run(tmp_path, "tiny_hybrid")
    model, cache = report["model"], report["cache"]
    assert model["class"] == "Qwen3_5ForCausalLM"
    assert model["layer_type_counts"] == {"full_attention": 1, "linear_attention": 3}
    assert model["hidden_states_per_layer_plus_embeddings"] is True
    assert cache["reports_croppable"] in (False, "not reported")
    # Either the release refuses to crop (and says why) or the crop leaves the recurrent state behind.
    outcomes = [cache["native_crop"]] + ([cache["recording_crop"]] if "recording_crop" in cache else [])
    failed = [o for o in outcomes if o["result"] != "ok"]
    wrong = [o for o in outcomes if o["result"] == "ok" and o["logits_max_abs_diff"] > 1e-4]
    assert failed or wrong
    for outcome in failed:
        assert ":" in outcome["result"], "the exact error (type: message) is reported"
    assert summary["native crop"] == cache["native_crop"]["result"]
    # ...while the hybrid-aware cache verifies a tree and commits a path exactly.
    assert report["hybrid_cache"]["tree_verify_max_abs_diff"] < 1e-5
    assert report["hybrid_cache"]["commit_logits_max_abs_diff"] < 1e-5


def test_probe_answers_reach_the_event_log(tmp_path: Path) -> None:
    report, _, events = run(tmp_path, "tiny_hybrid")
    params = {k: v for e in events if e.kind == "params" for k, v in e.data.items()}
    metrics = {k: v for e in events if e.kind == "metrics" for k, v in e.data.items()}
    assert params["probe.model.class"] == "Qwen3_5ForCausalLM"
    assert params["probe.model.layer_type_counts"] == "full_attention=1, linear_attention=3"
    assert params["probe.cache.native_crop.result"] == report["cache"]["native_crop"]["result"]
    assert params["layout.gdn_key_value_heads"] == "2/4 (r=2)" and params["layout.pattern"] == "gdn+gdn+gdn+attention"
    assert params["layout.draft_layer_types"] == "attention" and params["layout.draft_target_layers"] == "0,2"
    assert metrics["probe.model.num_parameters"] == report["model"]["num_parameters"]
    assert [e.data["path"] for e in events if e.kind == "artifact"] == [PROBE_FILE]
    progress = [e.data["completed"] for e in events if e.kind == "progress"]
    assert progress == sorted(progress) and progress[-1] == 5


@pytest.mark.parametrize("crop", [0, 16])
def test_crop_outside_the_prefill_is_refused(tmp_path: Path, crop: int) -> None:
    raw = probe_spec(tmp_path, "tiny_dense")
    raw["probe"]["crop_tokens"] = crop
    spec = parse_spec(raw, tmp_path)
    with pytest.raises(ValueError, match="crop_tokens"):
        run_probe(spec, EventLog(tmp_path))
