"""The spec a test hands the worker directly (no orchestrator in between): the tiny hybrid model, decoding.

Only omegaconf and the config folder's path: `make test-compat` imports it under the worker's dependencies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from orchestrator import CONF_DIR


def decode_spec(run_dir: Path, *, num_prompts: int, model: dict[str, Any] | None = None, **decode: Any) -> dict:
    """`spec.json` for experiment=ddtree_gdn on tiny_hybrid; `model` changes the model section, `decode` is
    the decode section."""
    tiny_hybrid = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "tiny_hybrid.yaml"))
    assert isinstance(tiny_hybrid, dict)
    return {
        "run_id": "t",
        "run_dir": str(run_dir),
        "seed": 0,
        "experiment": {"name": "ddtree_gdn", "num_prompts": num_prompts},
        "model": {**tiny_hybrid, **(model or {})},
        "decode": decode,
    }
