"""The checkout's commit, dirty flag and diff, recorded with every run."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass

from orchestrator.config.paths import PROJECT_ROOT


@dataclass(frozen=True)
class GitInfo:
    commit: str
    dirty: bool
    diff: str


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    """A git command in this checkout (no git at all reads as a failed command). Its output is decoded as
    UTF-8 with bad bytes replaced: a diff of a Latin-1 file must not stop the run."""
    try:
        done = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), *args],
            capture_output=True,
            encoding="utf-8",
            errors="replace",
            stdin=subprocess.DEVNULL,
        )
    except OSError as error:
        return subprocess.CompletedProcess(args, 127, "", str(error))
    if done.returncode == -signal.SIGINT:  # the terminal's Ctrl-C reached git too: an interruption, not "no git"
        raise KeyboardInterrupt
    return done


def git_info() -> GitInfo:
    """`unknown` outside a git checkout (for example an unpacked release)."""
    head = _git("rev-parse", "HEAD")
    if head.returncode != 0:
        return GitInfo(commit="unknown", dirty=False, diff="")
    status = _git("status", "--porcelain", "--untracked-files=no").stdout
    diff = _git("diff", "HEAD").stdout if status.strip() else ""
    return GitInfo(commit=head.stdout.strip(), dirty=bool(status.strip()), diff=diff)
