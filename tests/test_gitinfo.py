"""The commit, dirty flag and diff every run records: read from git, whatever the checkout holds."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.tracking import gitinfo


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "notes.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    git(repo, "add", "notes.txt")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "-m", "first")
    monkeypatch.setattr(gitinfo, "PROJECT_ROOT", repo)
    return repo


def test_a_clean_checkout_is_its_commit_and_no_diff(checkout: Path) -> None:
    info = gitinfo.git_info()
    assert len(info.commit) == 40 and not info.dirty and info.diff == ""


def test_a_diff_that_is_not_utf8_is_recorded_not_fatal(checkout: Path) -> None:
    (checkout / "notes.txt").write_bytes("na\xefve\n".encode("latin-1"))
    info = gitinfo.git_info()
    assert info.dirty
    assert "+na\ufffdve" in info.diff, "the bad byte is replaced, the rest of the diff kept"


def test_outside_a_checkout_the_commit_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gitinfo, "PROJECT_ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert gitinfo.git_info() == gitinfo.GitInfo(commit="unknown", dirty=False, diff="")
