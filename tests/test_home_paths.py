"""`~` and `$HOME` in a local path setting work as typed; a host's paths are the host's to resolve."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from orchestrator.config.home_paths import expand_local_paths


def parsed(arg: str) -> str:
    return OverridesParser.create().parse_override(arg).value()


def test_tilde_and_home_expand_in_local_path_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "a home with 'quotes' and \\ spaces"
    monkeypatch.setenv("HOME", str(home))
    args = [
        "experiment.datasets_dir=~/hf-datasets",
        "orchestrator.state_dir=$HOME/state",
        "+experiment.prompts=${HOME}/mine.jsonl",
        "host.workdir=~/ddtree",  # the host's home, not this machine's
        "orchestrator.state_dir=${hydra:runtime.cwd}/state",  # Hydra's own interpolation
        "experiment.datasets_dir='~/quoted'",  # quoted for Hydra: taken as typed (expanded where it is read)
    ]
    out = expand_local_paths(args)
    assert [parsed(arg) for arg in out[:3]] == [f"{home}/hf-datasets", f"{home}/state", f"{home}/mine.jsonl"]
    assert out[3:] == args[3:]


def test_the_documented_paper_command_parses() -> None:
    """The docs' `experiment.datasets_dir=~/hf-datasets` stopped with Hydra's LexerNoViableAltException."""
    with pytest.raises(Exception, match="token recognition error"):
        parsed("experiment.datasets_dir=~/hf-datasets")
    (arg,) = expand_local_paths(["experiment.datasets_dir=~/hf-datasets"])
    assert parsed(arg) == str(Path.home() / "hf-datasets")
