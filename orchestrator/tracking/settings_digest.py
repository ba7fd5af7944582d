"""A job's settings digest (`orchestrator.config_hash`): what decides its figures, so that a sweep run again
can find a run that already has them (`sweep/resume.py`).

The digest covers the worker's sections of the resolved config (experiment, model, decode, probe) and the
seed, flattened and cut as the run's params are, and the SHA-256 of the prompt set's text (`prompts.sha256`,
logged as a param beside them). Where a local mirror sits (`experiment.datasets_dir`) is left out: the prompts'
text is in the digest itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from orchestrator.config.redaction import to_params

HASHED_SECTIONS = ("experiment", "model", "decode", "probe")
LEFT_OUT = ("experiment.datasets_dir",)  # where the prompts were read from; their text is hashed instead
PROMPTS_DIGEST = "prompts.sha256"  # the param holding the prompt set's digest ("none": the worker chooses)


def settings_params(resolved: Mapping[str, Any], prompts_text: str | None) -> dict[str, str]:
    """The params that decide a job's figures, as its run logs them (the digest's input)."""
    chosen = {key: resolved[key] for key in HASHED_SECTIONS if key in resolved}
    chosen["seed"] = resolved.get("seed")
    flat = to_params(chosen, MAX_PARAM_VAL_LENGTH)  # cut as at the run's creation
    params = {k: v for k, v in flat.items() if k not in LEFT_OUT}
    params[PROMPTS_DIGEST] = hashlib.sha256(prompts_text.encode()).hexdigest() if prompts_text is not None else "none"
    return params


def config_hash(params: Mapping[str, str]) -> str:
    """The digest of `settings_params`: equal settings, equal digest, whatever order the keys came in."""
    return hashlib.sha256(json.dumps(dict(params), sort_keys=True).encode()).hexdigest()[:32]
