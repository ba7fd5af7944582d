"""The layout a run loaded, read from its config, recorded as params, and a warning when make test never
checked it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers

from orchestrator.stream.events import split_events
from remote_worker.events import EVENTS_FILE, EventLog
from remote_worker.experiments.probe import run_probe
from remote_worker.models.layout import DraftLayout, TargetLayout, layout_params, published, uncovered_warning
from remote_worker.models.loading import load_model
from remote_worker.models.twins import twin_cases
from remote_worker.spec import ModelSpec, parse_spec

# worker: only the worker's dependencies; compat: it touches transformers, so `make test-compat` runs it
# under the oldest supported release too
pytestmark = [pytest.mark.worker, pytest.mark.compat]

QWEN36 = next(case for case in twin_cases() if case.id == "Qwen3.6-27B-DFlash")


def test_the_published_layouts_read_as_their_model_cards_say() -> None:
    qwen36 = TargetLayout.of(published()["Qwen3.6-27B"])
    assert qwen36.pattern == ("gdn", "gdn", "gdn", "attention")
    assert qwen36.gdn_heads == (16, 48) and qwen36.attention_heads == (24, 4) and qwen36.gated_attention
    assert qwen36.partial_rotary == 0.25 and qwen36.mrope_section == (11, 11, 10) and qwen36.experts is None
    nxt = TargetLayout.of(published()["Qwen3-Next-80B-A3B"])  # layer types from full_attention_interval
    assert nxt.pattern == qwen36.pattern and nxt.gdn_heads == (16, 32) and nxt.attention_heads == (16, 2)
    assert nxt.experts == (10, True) and nxt.gated_attention and nxt.mrope_section is None
    dense = TargetLayout.of(published()["Qwen3-8B"])
    assert dense.pattern == ("attention",) and dense.gdn_heads is None and not dense.gated_attention
    draft = DraftLayout.of(published()["Qwen3.6-27B-DFlash"])
    assert draft.layer_types == ("sliding",) * 4 + ("attention",) and draft.windowed and draft.block_size == 16
    nested = DraftLayout.of(published()["Qwen3.6-35B-A3B-DFlash.nested"])
    assert nested.nested_block_size and nested.block_size == 16 and nested.target_layers == 8
    # no use_sliding_window: transformers' Qwen3Config drops the window, so its sliding layers are only causal
    assert not nested.windowed


def test_a_twin_run_records_its_layout_and_is_covered() -> None:
    twin = QWEN36.target
    model = load_model(ModelSpec("t", "config", twin.arch, "float32", "cpu", twin.config, None), seed=0)
    params, warning = layout_params(model, QWEN36.draft.config)
    assert warning is None
    assert params["layout.tested_as"] == "Qwen3.5-27B, Qwen3.6-27B"  # one text architecture
    assert params["layout.draft_tested_as"] == "Qwen3.6-27B-DFlash"
    assert params["layout.gdn_key_value_heads"] == "16/48 (r=3)"
    assert params["layout.attention_query_kv_heads"] == "24/4" and params["layout.gated_attention"] == "True"
    assert params["layout.pattern"] == "gdn+gdn+gdn+attention"
    assert params["layout.partial_rotary"] == "0.25" and params["layout.mrope_section"] == "11,11,10"
    assert params["layout.draft_layer_types"] == "sliding,sliding,sliding,sliding,attention"
    assert params["layout.draft_window"] == str(QWEN36.draft.window)
    assert params["layout.draft_target_layers"] == ",".join(
        map(str, QWEN36.draft.config["dflash_config"]["target_layer_ids"])
    )


def test_an_untested_layout_is_one_warning_line() -> None:
    layout = TargetLayout.of({**QWEN36.target.config, "model_type": "qwen3_5_text", "linear_num_value_heads": 64})
    warning = uncovered_warning(layout, None)
    assert warning is not None and "\n" not in warning and len(warning) < 300
    assert "GDN 16/64" in warning and "remote_worker/data/model_configs/" in warning


def test_the_probe_records_the_layout_and_warns_for_an_untested_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint with a layout no twin has: its run says so in one warning line; the layout is params."""
    config = {**QWEN36.target.config, "linear_num_value_heads": 32, "linear_num_key_heads": 8}
    torch.manual_seed(0)
    cls = transformers.Qwen3_5ForCausalLM
    cls(cls.config_class(**config)).save_pretrained(tmp_path / "ckpt")
    model = {"name": "odd", "source": "pretrained", "arch": cls.__name__, "path": str(tmp_path / "ckpt"),
             "dtype": "float32", "device": "cpu", "config": {}}  # fmt: skip
    raw = {"run_id": "t", "run_dir": str(tmp_path), "seed": 0, "experiment": {"name": "probe"}, "model": model,
           "probe": {"prefill_tokens": 8, "crop_tokens": 2, "tree_size": 6}}  # fmt: skip
    log = EventLog(tmp_path)
    with caplog.at_level(logging.WARNING, logger="remote_worker"):
        run_probe(parse_spec(raw, tmp_path), log)
    log.close()
    warnings = [r.getMessage() for r in caplog.records if "layout never checked" in r.getMessage()]
    assert len(warnings) == 1 and "GDN 8/32" in warnings[0]
    events, _ = split_events((tmp_path / EVENTS_FILE).read_bytes())
    params = {k: v for e in events if e.kind == "params" for k, v in e.data.items()}
    assert params["layout.gdn_key_value_heads"] == "8/32 (r=4)" and params["layout.tested_as"] == "none"
    assert json.loads((tmp_path / "probe.json").read_text())["layout"]["layout.pattern"] == "gdn+gdn+gdn+attention"


@pytest.mark.parametrize("name", sorted(published()))
def test_a_published_checkpoint_loads_as_the_layout_its_config_says(name: str) -> None:
    """The config class a run builds from each published config.json gives back the same layout (what a
    run records is what make test's twin of it was checked at)."""
    from remote_worker.models.dflash import draft_config
    from remote_worker.models.layout import is_draft, text_config
    from remote_worker.models.twins import text_arch

    values = published()[name]
    if is_draft(values):
        assert DraftLayout.of(draft_config(values).to_dict()) == DraftLayout.of(values)
        return
    cls = getattr(transformers, text_arch(values["architectures"]))
    text = {k: v for k, v in text_config(values).items() if k != "model_type"}
    assert TargetLayout.of(cls.config_class(**text).to_dict()) == TargetLayout.of(values)
