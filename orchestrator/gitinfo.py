"""The checkout's commit, dirty flag and diff, recorded with every run."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator import PROJECT_ROOT
from orchestrator.transport import LocalTransport


@dataclass(frozen=True)
class GitInfo:
    commit: str
    dirty: bool
    diff: str


def git_info() -> GitInfo:
    """`unknown` outside a git checkout (for example an unpacked release)."""
    local = LocalTransport()
    git = ["git", "-C", str(PROJECT_ROOT)]
    head = local.run([*git, "rev-parse", "HEAD"], check=False)
    if not head.ok:
        return GitInfo(commit="unknown", dirty=False, diff="")
    status = local.run([*git, "status", "--porcelain", "--untracked-files=no"], check=False).stdout
    diff = local.run([*git, "diff", "HEAD"], check=False).stdout if status.strip() else ""
    return GitInfo(commit=head.stdout.strip(), dirty=bool(status.strip()), diff=diff)
