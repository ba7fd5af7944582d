"""The README's quick start, run as written: the commands between its quick-start markers, on a copy of the
checkout (so the runs land in the copy's own store, not the developer's), and its sample summary held to
what `make run` really prints.

`make test` itself is left out: it is the suite this test belongs to.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.cli.help import help_text
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.slow

README = PROJECT_ROOT / "README.md"
START, END = "<!-- quick-start:", "<!-- /quick-start -->"


def quick_start() -> list[str]:
    """The commands of the quick-start block, comments dropped, in order."""
    text = README.read_text(encoding="utf-8")
    block = text.split(START, 1)[1].split("\n", 1)[1].split(END, 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def readme_summary_rows() -> list[str]:
    """The row names of the sample `Run summary` table the README shows under `make run`."""
    text = README.read_text(encoding="utf-8")
    table = text.split("Run summary", 1)[1].split("└", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\s*│ (\S+)\s+│", table, re.MULTILINE)]


def printed_summary_rows(output: str) -> list[str]:
    table = output.split("Run summary", 1)[1].split("└", 1)[0]
    return [m.group(1) for m in re.finditer(r"^│ (\S+)\s+│", table, re.MULTILINE)]


@pytest.fixture
def checkout_copy(tmp_path: Path) -> Path:
    """The checkout's files (tracked and untracked, not ignored) with their times kept, beside the real .venv:
    `make` then finds the venv installed and runs the copy's code (PROJECT_ROOT, its store, its .work)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=PROJECT_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    copy = tmp_path / "checkout"
    for name in filter(None, listed):
        source = PROJECT_ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    (copy / ".venv").symlink_to(PROJECT_ROOT / ".venv")
    stale = subprocess.run(["make", "-q", ".venv/.installed"], cwd=copy, capture_output=True, check=False)
    if stale.returncode != 0:
        # Running `make run` now would reinstall the real .venv's editable install pointing at the copy.
        message = "the .venv is older than the requirements: run `make run` once first"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    yield copy
    # The local host's worker is detached; it has ended by the time its run's command returns, but its run
    # folders and the store are files in tmp_path, removed with it.


def test_the_quick_start_runs_as_written(checkout_copy: Path) -> None:
    commands = quick_start()
    assert commands[:2] == ["make run", "make test"], commands
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(checkout_copy)}
    env.pop("VIRTUAL_ENV", None)
    outputs = {}
    for command in commands:
        if command == "make test":
            continue
        done = subprocess.run(shlex.split(command), cwd=checkout_copy, env=env, capture_output=True, text=True,
                              timeout=600, check=False)  # fmt: skip
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "Downloading artifacts" not in done.stdout + done.stderr, command  # MLflow's bars as runs are signed
        outputs[command] = done.stdout

    ran = outputs["make run"]
    assert "│ status      │ FINISHED" in ran, ran[-3000:]
    assert printed_summary_rows(ran) == readme_summary_rows(), ran[-3000:]
    for method in ("dflash", "ddtree_tb16", "ddtree_tb32", "ddtree_tb64"):
        row = ran.split(f"│ {method}", 1)[1].split("│ ddtree_tb", 1)[0].split("│ best", 1)[0]
        assert "lossless 1.00" in " ".join(row.replace("│", " ").split()), (method, row)
    assert (checkout_copy / "mlruns.db").is_file()  # the copy's store, not the developer's

    probe = next(c for c in commands if "experiment=probe" in c)
    assert "FINISHED" in outputs[probe]
    listed = outputs[next(c for c in commands if "list=all" in c)]
    assert listed.count("FINISHED") >= 2, listed
    assert outputs[next(c for c in commands if "--help" in c)].strip() == help_text(80).strip()


TRY_START, TRY_END = "<!-- paper-try-out:", "<!-- /paper-try-out -->"


def paper_try_out() -> str:
    text = README.read_text(encoding="utf-8")
    block = text.split(TRY_START, 1)[1].split("\n", 1)[1].split(TRY_END, 1)[0]
    (command,) = [line.strip() for line in block.splitlines() if line.strip()]
    return command


def test_the_paper_sections_try_out_runs_as_written(checkout_copy: Path, tmp_path: Path) -> None:
    """`experiment.datasets_dir=~/hf-datasets` as typed (Hydra's grammar has no `~`), over a mirror in the hub's
    layout under a HOME of the test's own; the sweep ends on the paper's table at 80 columns."""
    from tests.paper_mirror import build_mirror

    home = tmp_path / "home"
    build_mirror(home / "hf-datasets", rows_per_set=2, odd=True)
    command = paper_try_out()
    assert command.startswith("python -m orchestrator --multirun sweep=paper") and "=~/hf-datasets" in command
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(checkout_copy), "HOME": str(home)}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "hf-cache")
    argv = [str(PROJECT_ROOT / ".venv" / "bin" / "python"), *shlex.split(command)[1:]]
    done = subprocess.run(argv, cwd=checkout_copy, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("The paper's table: tiny_trained"))
    table = lines[start : start + 5]
    assert table[1].split() == ["T=0"] and table[2].split() == ["dataset", "DFlash", "DDTree", "budget"], table
    assert table[3].split()[0] == "gsm8k" and table[4].startswith("mean (1 set)"), table
    assert max(len(line) for line in table) <= 80
