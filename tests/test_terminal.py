"""What the user reads at a terminal, rendered as it prints, at 80 columns (and narrower where it matters)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orchestrator.cli.help import help_text
from remote_worker.wording import counted
from tests.conftest import PROJECT_ROOT


@pytest.mark.parametrize("width", [80, 60, 120])
def test_help_fits_the_terminal_breaks_between_words_and_names_the_bare_run(width: int) -> None:
    page = help_text(width)
    lines = page.splitlines()
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    words = set(" ".join(lines).split())
    for choice in ("tiny_trained,", "tiny_qwen3_next,", "qwen3_coder_next,", "tiny_trained_dense"):
        assert choice in words, f"{choice} cut at a line's end"
    assert "host=local model=tiny_trained" in " ".join(page.split())


def test_help_is_printed_by_the_entry_point_at_the_terminals_width() -> None:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(PROJECT_ROOT)}
    done = subprocess.run([sys.executable, "-m", "orchestrator", "--help"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == help_text(80).strip(), done.stderr


@pytest.mark.parametrize(("count", "text"), [(0, "0 prompts"), (1, "1 prompt"), (2, "2 prompts")])
def test_counts_are_said_in_words(count: int, text: str) -> None:
    assert counted(count, "prompt") == text


def test_a_host_file_that_leaves_its_python_to_the_user_asks_for_it_in_one_line(tmp_path) -> None:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(PROJECT_ROOT)}
    done = subprocess.run([sys.executable, "-m", "orchestrator", "host=localhost_ssh"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "config error: host.python has no value in this config: give the host's Python interpreter (its absolute "
        "path, e.g. /usr/bin/python3) on the command line (host.python=...)"
    ]


def test_two_commands_that_open_a_fresh_local_store_at_once_both_start(tmp_path) -> None:
    """`make run` and `make sweep` on a fresh checkout: both create the SQLite store at the same moment (its
    schema migrated by the first request); without the lock around that first request, one of them failed with
    pages of SQL (seen in 3 of 3 tries)."""
    import time

    script = (
        "import sys, time\n"
        "from orchestrator.config.settings import TrackingConfig\n"
        "from orchestrator.tracking.client import open_tracking\n"
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"  # both at once, without spinning a core
        "open_tracking(TrackingConfig('local', sys.argv[1], None, 30, 30))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    for attempt in range(2):
        uri, start = f"sqlite:///{tmp_path / f'mlruns{attempt}.db'}", str(time.time() + 6)
        both = [subprocess.Popen([sys.executable, "-c", script, uri, start], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
        for process in both:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0 and out.strip() == "ok", err[-2000:]
