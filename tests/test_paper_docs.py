"""The paper's commands in `docs/paper.md` and the README, run as written up to the GPU.

A command that names a GPU host (`host=kpro5`) cannot decode here; what it can do is everything a sweep does
before its first job, and that is where a documented command goes wrong: a setting the config refuses, an
override Hydra's grammar cannot read (`~`), a host pool naming no config, a dataset folder the sweep cannot
read, a plan line that is not what the docs show. Each command is run with `sweep.dry_run=true` added (the
sweep's checks of every job and its plan, then nothing starts) over a mirror in the hub's layout at the paper's
sizes, in a HOME of the test's own; the variants the docs give inline are run on the documented command. The
commands that decode on the tiny pair are run in full by `tests/test_readme.py` and `tests/test_paper_sweep.py`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from orchestrator.config.paper_datasets import PAPER_SETS
from tests.conftest import PROJECT_ROOT
from tests.paper_mirror import build_mirror

pytestmark = pytest.mark.slow

PAPER_DOC = PROJECT_ROOT / "docs" / "paper.md"
README = PROJECT_ROOT / "README.md"
PLAN = "plan: 20 jobs · 2,304 records · 5,332 decodes (a method over a record)"  # the docs' plan line


def shown_commands(text: str) -> list[str]:
    """The indented `python -m orchestrator …` commands of a markdown text (continuation lines joined, comments
    dropped), and the `for repo in …; do …; done` download loop as one line."""
    commands, pending = [], ""
    for line in text.splitlines():
        if not line.startswith("    ") and not pending:
            continue
        code = line.strip()
        if pending:
            pending += " " + code
        elif code.startswith(("python -m orchestrator", "for repo in")):
            pending = code
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if pending.startswith("for ") and not pending.endswith("; done") and code != "done":
            pending += ";" * pending.endswith('"$repo"')  # the loop's body: up to its `done`
            continue
        commands.append(pending.split(" # ", 1)[0].split("  #", 1)[0].strip())
        pending = ""
    return commands


def inline_overrides(text: str) -> list[str]:
    """The backticked overrides the docs give as variants of the documented command."""
    wanted = ("sweep.hosts=", "hydra/launcher=submitit_slurm", "experiment.shard=0/4", "decode.tree_budgets=[16",
              "decode.protocol=grid")  # fmt: skip
    return sorted({m for m in re.findall(r"`([^`\s]+)`", text) if m.startswith(wanted)})


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HOME with `~/hf-datasets`, every set at least its paper size (its N rows, MT-Bench's 80), every prompt
    column carrying the odd characters; and `kpro6`, the second host of the docs' pool, as a user's own config
    folder holds it."""
    root = tmp_path_factory.mktemp("paper-docs")
    build_mirror(root / "home" / "hf-datasets", rows_per_set=170, odd=True)
    hosts = root / "conf" / "host"
    hosts.mkdir(parents=True)
    kpro5 = (PROJECT_ROOT / "conf" / "host" / "kpro5.yaml").read_text(encoding="utf-8")
    (hosts / "kpro6.yaml").write_text(kpro5.replace("kpro5", "kpro6"), encoding="utf-8")
    return root


def dry_run(home: Path, command: str) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "orchestrator"], command
    if not any(a.startswith("experiment.datasets_dir=") for a in argv):
        argv.append("experiment.datasets_dir=~/hf-datasets")  # the hub is out of reach here: its mirror
    argv += ["sweep.dry_run=true", f"hydra.searchpath=[file://{home / 'conf'}]"]
    env = {**os.environ, "HOME": str(home / "home"), "COLUMNS": "80", "HF_DATASETS_CACHE": str(home / "hf-cache")}
    argv[0] = str(PROJECT_ROOT / ".venv" / "bin" / "python")
    return subprocess.run(argv, cwd=home, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_download_loops_fetch_the_ten_sets_the_protocol_reads() -> None:
    for text in (PAPER_DOC.read_text(encoding="utf-8"), README.read_text(encoding="utf-8")):
        (loop,) = [c for c in shown_commands(text) if c.startswith("for repo in")]
        repos = loop.removeprefix("for repo in").split(";", 1)[0].split()
        assert repos == [paper_set.repo for paper_set in PAPER_SETS]
        assert 'hf download --repo-type dataset "$repo" --local-dir ~/hf-datasets/"$repo"' in loop


def test_every_documented_paper_command_passes_the_sweeps_checks_and_plans_what_the_docs_say(home: Path) -> None:
    doc, readme = PAPER_DOC.read_text(encoding="utf-8"), README.read_text(encoding="utf-8")
    paper_section = readme.split("## The paper's benchmark", 1)[1].split("\n## ", 1)[0]
    documented = [c for c in shown_commands(doc) + shown_commands(paper_section) if c.startswith("python")]
    gpu_commands = sorted({c for c in documented if "host=kpro5" in c})
    assert len(gpu_commands) == 2, documented  # with the joblib launcher, and with the mirror
    plain = next(c for c in gpu_commands if "hydra/launcher" not in c)  # the variants' launchers replace joblib
    variants = inline_overrides(doc)
    assert len(variants) == 5, variants
    grid = [v for v in variants if v.startswith(("decode.protocol=", "decode.tree_budgets="))]  # given together
    alone = [f"{plain} {shlex.quote(v)}" for v in variants if v not in grid]
    assert PLAN in doc and PLAN in readme
    for command in [*gpu_commands, *alone, f"{plain} {' '.join(map(shlex.quote, grid))}"]:
        done = dry_run(home, command)
        out = done.stdout
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{out[-2000:]}\n{done.stderr[-2000:]}"
        assert "dry run:" in out and "nothing started" in out, out
        plan = next(line for line in out.splitlines() if line.startswith("plan: "))
        if "experiment.shard=" in command:  # each shard samples its own records, at least 16
            assert plan.startswith("plan: 80 jobs · 2,304 records · 7,152 decodes"), (command, plan)
        elif "decode.protocol=grid" in command:
            assert plan.startswith("plan: 20 jobs · 2,304 records · 20,736 decodes"), (command, plan)  # 9 methods
        else:
            assert plan == PLAN, (command, plan)
    # "Any single run can use a set too": one run, checked (its prompts read from the mirror) and not started.
    assert "`experiment.prompts=gsm8k`" in doc
    done = dry_run(home, "python -m orchestrator model=qwen3_6_27b host=kpro5 experiment.prompts=gsm8k")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "dry run: the config checks; nothing started (drop sweep.dry_run to run it)"
    missing = dry_run(home, "python -m orchestrator host=kpro5 experiment.prompts=gsm8k experiment.datasets_dir=/no")
    assert missing.returncode == 2 and "openai/gsm8k is not in /no" in missing.stderr, missing.stderr


def test_a_dry_run_reports_every_mistake_of_every_job_and_starts_nothing(home: Path) -> None:
    """What a job would have said at its turn (a setting out of range, a pool host with no config) is said before
    anything starts; the jobs a mistake stops are named as ranges, so 20 jobs stay one line."""
    command = "python -m orchestrator --multirun sweep=paper model=qwen3_6_27b host=kpro5"
    for extra, error in (
        ("decode.block_size=0", "config error: jobs #0–#19: decode.block_size=0 must be an integer >= 2"),
        ("sweep.hosts=[kpro5,kpro7]",
         "config error: job #0: sweep.hosts: no host config named 'kpro7' (conf/host/kpro7.yaml)"),
    ):  # fmt: skip
        done = dry_run(home, f"{command} {extra}")
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip().splitlines() == [error], done.stderr
        assert "plan:" not in done.stdout and "sweep run:" not in done.stdout, done.stdout


def test_composing_a_job_from_its_group_choices_equals_hydras_own_composition(tmp_path: Path) -> None:
    """The sweep's check composes in full once per set of group choices and applies plain values to a copy
    (`JobComposer`); every job of a grid with groups, plain values, a list, a quoted path and an append must
    come out as Hydra's own `load_sweep_config` composes it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    from orchestrator.config.paths import CONF_DIR
    from orchestrator.sweep.precheck import JobComposer

    task = ["sweep=paper", "model=qwen3_6_27b", "host=kpro5", f"experiment.datasets_dir='{tmp_path}/a b'"]
    jobs = [
        [*task, "experiment.prompts=gsm8k", "decode.temperature=0"],
        [*task, "experiment.prompts=mt-bench", "decode.temperature=1", "experiment.shard=1/4"],
        [*task, "decode.tree_budgets=[16,32]", "decode.temperature=0.5", "experiment.prompts=aime24"],
        [*task, "model=tiny_trained", "experiment.prompts=alpaca", "+experiment.note=x", "host.port=2222"],
        [*task, "hydra/launcher=joblib", "host=local", "experiment.num_prompts=3", "seed=7"],
        [*task, "experiment.prompts=gsm8k", "decode.temperature=1"],
    ]

    def plain(config: object) -> dict:
        config = OmegaConf.create(config)  # type: ignore[arg-type]
        with open_dict(config):
            del config["hydra"]
        return OmegaConf.to_container(config, resolve=False)  # type: ignore[return-value]

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            master = compose("config", overrides=task, return_hydra_config=True)
            composer = JobComposer(master)
            loader = GlobalHydra.instance().config_loader()
            for overrides in jobs:
                assert plain(composer.job(overrides)) == plain(loader.load_sweep_config(master, overrides)), overrides
            assert len(composer.composed) == 3  # jobs 1, 2, 3 and 6 share their groups; 4 and 5 are composed whole
    finally:
        GlobalHydra.instance().clear()
