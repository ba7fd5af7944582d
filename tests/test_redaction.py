"""Secrets never reach MLflow params: secret-looking keys at any depth, and passwords inside URLs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.redaction import REDACTED, flatten, is_secret_key, redact, redact_url, to_params


def test_secret_keys_are_recognised_by_whole_word() -> None:
    for key in ("HF_TOKEN", "db_password", "client_secret", "api_key", "apiKey", "MLFLOW_TRACKING_TOKEN", "passwd"):
        assert is_secret_key(key), key
    for key in ("max_new_tokens", "prefill_tokens", "linear_key_head_dim", "tokenizer", "secretary_count"):
        assert not is_secret_key(key), key


def test_nested_secrets_are_redacted_and_settings_kept() -> None:
    config = {
        "host": {"env": {"HF_TOKEN": "hf_abc123", "CUDA_LAUNCH_BLOCKING": "1"}},
        "tracking": {"uri": "https://alice:s3cr3t@mlflow.example/", "password": "hunter2"},
        "decode": {"max_new_tokens": 64},
    }
    params = to_params(config, max_length=500)
    assert params["host.env.HF_TOKEN"] == REDACTED
    assert params["host.env.CUDA_LAUNCH_BLOCKING"] == "1"
    assert params["tracking.uri"] == f"https://alice:{REDACTED}@mlflow.example/"
    assert params["tracking.password"] == REDACTED
    assert params["decode.max_new_tokens"] == "64"
    assert not any(secret in value for value in params.values() for secret in ("hf_abc123", "s3cr3t", "hunter2"))


def test_url_without_password_is_unchanged() -> None:
    assert redact_url("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact_url("https://bob@host/x") == "https://bob@host/x"


def test_long_values_are_truncated_with_a_marker() -> None:
    params = to_params({"prompt": "x" * 1000}, max_length=100)
    assert len(params["prompt"]) == 100
    assert params["prompt"].endswith("whole value in config.yaml)")


def test_flatten_keeps_lists_whole_and_dots_keys() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": 1, "a.c": [1, 2], "d": {}}


secret_words = st.sampled_from(["token", "password", "secret", "api_key", "HF_TOKEN", "Password"])
plain_keys = st.text(alphabet="abcdefghij_", min_size=1, max_size=8)
secret_values = st.text(alphabet="QWXYZ0123456789", min_size=12, max_size=20)


@given(path=st.lists(plain_keys, min_size=0, max_size=3), word=secret_words, value=secret_values)
def test_a_secret_at_any_depth_never_reaches_params(path: list[str], word: str, value: str) -> None:
    nested: dict = {f"my_{word}": value, "other": "visible"}
    for key in reversed(path):
        nested = {key: nested}
    params = to_params(nested, max_length=6000)
    assert all(value not in v for v in params.values())
    assert "visible" in params.values()
    assert redact(nested) != nested
