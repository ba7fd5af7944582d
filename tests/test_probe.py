"""experiment=probe on the tiny models: what the cache does on a dense and on a hybrid (GDN) model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from orchestrator import CONF_DIR
from orchestrator.lifecycle.display import summary_table
from orchestrator.stream.events import split_events
from remote_worker.cache import hybrid_cache
from remote_worker.events import EVENTS_FILE, EventLog
from remote_worker.experiments.probe import PROBE_FILE, run_probe
from remote_worker.probes.hybrid_cache_check import verdict
from remote_worker.spec import parse_spec

# worker: only the worker's dependencies; compat: it touches transformers, so `make test-compat` runs it
# under the oldest supported release too
pytestmark = [pytest.mark.worker, pytest.mark.compat]


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


def rendered(summary: dict[str, str]) -> str:
    """The run summary as the terminal shows it at 80 columns."""
    console = Console(width=80, record=True, color_system=None)
    console.print(summary_table("FINISHED", None, summary, {}))
    return console.export_text()


def test_the_hybrid_cache_is_judged_against_the_rounding_bound_of_its_own_logits(tmp_path: Path) -> None:
    """The trained tiny pair's logits reach ~13, so float32 differences of ~7e-6 are rounding (a random tiny
    model's logits stay below 1, hence ~2e-7 there): the probe reports the bound the arithmetic allows at this
    scale, 2·λ·(layers+1)·√(longest sum)·u·max|logit|, and its verdict, not a fixed figure."""
    report, summary, events = run(tmp_path, "tiny_trained")
    hybrid = report["hybrid_cache"]
    layers, longest = 4, 384  # the fixture's 4 layers (+ the head); its MLP sums 384 products
    expected = 2 * 8.0 * (layers + 1) * math.sqrt(longest) * 2.0**-24 * hybrid["logits_scale"]
    assert hybrid["rounding_bound"] == pytest.approx(expected, rel=1e-12)
    assert hybrid["logits_scale"] > 5  # a trained model: the regime where a fixed 1e-7 was wrong
    assert 0 < hybrid["tree_verify_max_abs_diff"] <= hybrid["rounding_bound"]
    assert hybrid["commit_logits_max_abs_diff"] <= hybrid["rounding_bound"]
    assert hybrid["exact"] == "yes"
    metrics = {k: v for e in events if e.kind == "metrics" for k, v in e.data.items()}
    params = {k: v for e in events if e.kind == "params" for k, v in e.data.items()}
    assert metrics["probe.hybrid_cache.rounding_bound"] == hybrid["rounding_bound"]
    assert params["probe.hybrid_cache.exact"] == "yes"
    text = rendered(summary)
    bound = f"{hybrid['rounding_bound']:.3g} (logits up to {hybrid['logits_scale']:.3g})"
    assert f"│ hybrid cache: rounding bound        │ {bound}" in text, text
    assert "│ hybrid cache exact                  │ yes" in text, text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_cache_that_drops_the_committed_state_is_called_not_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verdict can fail: a commit that forgets the accepted path's GDN update (and so every prefill, which
    commits its chunks) is far beyond rounding."""
    monkeypatch.setattr(hybrid_cache, "commit_state", lambda state, *args, **kwargs: state)
    report, summary, _ = run(tmp_path, "tiny_trained")
    hybrid = report["hybrid_cache"]
    assert hybrid["commit_logits_max_abs_diff"] > 5 * hybrid["rounding_bound"]
    error = max(hybrid["tree_verify_max_abs_diff"], hybrid["commit_logits_max_abs_diff"])
    bound = hybrid["rounding_bound"]
    assert hybrid["exact"] == f"NO: {error:.3g} > {bound:.3g}"
    assert f"│ hybrid cache exact                  │ NO: {error:.3g} > {bound:.3g}" in rendered(summary)


def test_no_verdict_where_rounding_could_explain_any_difference() -> None:
    """Where the bound reaches the logits themselves (bfloat16 at real widths), "yes" would mean nothing."""
    assert verdict(0.5, bound=40.0, scale=20.0, dtype=torch.bfloat16) == "cannot tell in bfloat16: probe in float32"
    assert verdict(0.5, bound=0.6, scale=20.0, dtype=torch.float32) == "yes"
    assert verdict(0.7, bound=0.6, scale=20.0, dtype=torch.float32) == "NO: 0.7 > 0.6"
