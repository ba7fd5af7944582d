"""A dataset mirror is read only inside itself (`orchestrator.config.mirror_check`): every trick that read
outside it, or read what the paper's sets never are, is refused in one line before `datasets` opens a file."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.config.mirror_check import check_mirror
from orchestrator.config.paper_datasets import PAPER_SETS, load_paper_set
from remote_worker.prompt_set import PromptSetError
from tests.paper_mirror import build_mirror


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mirror(tmp_path_factory.mktemp("mirror") / "hf-datasets", rows_per_set=2)


def test_a_mirror_as_hf_download_leaves_it_passes(pristine: Path) -> None:
    """Every set of the hub's layout, LiveCodeBench's loading script beside the files it names included."""
    for paper_set in PAPER_SETS:
        check_mirror(pristine / paper_set.repo, pristine, paper_set.files)


def _private_key(tmp: Path) -> Path:
    key = tmp / "outside" / "id_ed25519"
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n-----END OPENSSH PRIVATE KEY-----\n")
    key.chmod(0o600)
    return key


def _link_a_parquet_out(root: Path, tmp: Path) -> str:
    data = root / "tatsu-lab" / "alpaca" / "data"
    (part,) = data.glob("train-*.parquet")
    outside = tmp / "outside" / "elsewhere.parquet"
    outside.parent.mkdir(parents=True, exist_ok=True)
    part.rename(outside)
    part.symlink_to(outside)
    return "alpaca"


def _link_the_repository_out(root: Path, tmp: Path) -> str:
    repo = root / "tatsu-lab" / "alpaca"
    repo.rename(tmp / "outside-alpaca")
    repo.symlink_to(tmp / "outside-alpaca")
    return "alpaca"


def _card_path_up(root: Path, tmp: Path) -> str:
    card = root / "tatsu-lab" / "alpaca" / "README.md"
    card.write_text(card.read_text().replace("path: data/train-*", "path: ../../../outside/*"))
    return "alpaca"


def _csv_link_to_a_key(root: Path, tmp: Path) -> str:
    (root / "HuggingFaceH4" / "MATH-500" / "train.csv").symlink_to(_private_key(tmp))
    return "math500"


def _a_csv_file(root: Path, tmp: Path) -> str:
    (root / "HuggingFaceH4" / "MATH-500" / "extra.csv").write_text("problem\nwhat is 1+1?\n")
    return "math500"


def _a_yaml_tag(root: Path, tmp: Path) -> str:
    card = root / "openai" / "gsm8k" / "README.md"
    card.write_text("---\nlicense: !!python/object/apply:os.system ['touch /tmp/x']\n---\n")
    return "gsm8k"


def _a_loading_script(root: Path, tmp: Path) -> str:
    (root / "openai" / "gsm8k" / "gsm8k.py").write_text("raise SystemExit('a loading script must not run')\n")
    return "gsm8k"


def _a_named_file_linked_out(root: Path, tmp: Path) -> str:
    named = root / "livecodebench" / "code_generation_lite" / "test3.jsonl"
    named.unlink()
    named.symlink_to(_private_key(tmp))
    return "livecodebench"


def _an_escape_in_a_name(root: Path, tmp: Path) -> str:
    (root / "HuggingFaceH4" / "MATH-500" / "x\x1b]0;pwned\x07.csv").write_text("a\n")
    return "math500"


TRICKS: dict[str, tuple[Callable[[Path, Path], str], str]] = {
    "symlinked parquet": (_link_a_parquet_out, ".parquet is a link out of the mirror; copy the file in its place"),
    "symlinked repository": (_link_the_repository_out, "alpaca is a link out of "),
    "card path with ..": (_card_path_up, "README.md names data files outside the mirror ('../../../outside/*')"),
    "csv link to a key": (_csv_link_to_a_key, "train.csv is a link out of the mirror"),
    "a csv file": (_a_csv_file, "extra.csv is a csv file; the paper's sets are Parquet or JSON Lines"),
    "a YAML tag": (_a_yaml_tag, "README.md: its YAML header does not read as plain YAML ("),
    "a loading script": (_a_loading_script, "gsm8k.py is a loading script, which is never run"),
    "a named file linked out": (_a_named_file_linked_out, "test3.jsonl is a link out of the mirror"),
    "an escape in a name": (_an_escape_in_a_name, "x\\x1b]0;pwned\\x07.csv is a csv file"),
}  # fmt: skip


@pytest.mark.parametrize("trick", list(TRICKS))
def test_a_mirror_that_reads_outside_itself_or_holds_other_data_is_refused_in_one_line(
    trick: str, tmp_path: Path, datasets_cache: Path
) -> None:
    root = build_mirror(tmp_path / "hf-datasets", rows_per_set=2)
    plant, says = TRICKS[trick]
    name = plant(root, tmp_path)
    with pytest.raises(PromptSetError) as refused:
        load_paper_set(name, root)
    line = str(refused.value)
    assert line.startswith(f"{name}: ") and says.replace("'", "") in line.replace("'", ""), line
    assert "\n" not in line and "\x1b" not in line and "secret" not in line
    assert not list(datasets_cache.rglob("*.arrow")), "datasets never opened the mirror"
    assert not os.path.exists("/tmp/x") or trick != "a YAML tag"
