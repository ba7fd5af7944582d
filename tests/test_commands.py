"""The commands that cannot be combined. detach=true, list=true, logs= and cancel=<run id> as a user runs them,
against a real MLflow server, are `test_trust_e2e.py`'s `test_last_is_this_shells_and_the_printed_lines_work_...`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_orchestrator

pytestmark = pytest.mark.slow


def test_commands_cannot_be_combined(tmp_path: Path) -> None:
    result = run_orchestrator(["detach=true", "list=true", f"tracking.uri=sqlite:///{tmp_path / 'x.db'}"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "config error: list and detach cannot be combined: choose one"
