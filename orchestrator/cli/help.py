"""`python -m orchestrator --help` (also `ddtree-orch --help`): the page, fitted to the terminal's width.

Hydra's own help page prints its template as written and each config group's choices on one line, which a
terminal then breaks in the middle of a word; this page is wrapped at word boundaries to the width it is
given. Hydra's page stays under `--hydra-help`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from omegaconf import OmegaConf

from orchestrator.config.paths import CONF_DIR

COMMANDS = (
    ("host=kpro5 experiment=ddtree_gdn", "run and follow; Ctrl-C stops the worker"),
    ("host=kpro5 detach=true", "launch, print the attach command, return"),
    ("host=kpro5 attach=<run>", "follow a run again"),
    ("host=kpro5 cancel=<run>", "stop a run's worker; the run ends KILLED"),
    ("host=kpro5 logs=<run> follow=true", "the worker's stderr and log lines"),
    ("host=kpro5 list=true", "runs alive on the host (list=all: all)"),
    ("--multirun sweep=default", "a grid: a parent run, a child per job"),
)


def _defaults(conf_dir: Path) -> dict[str, str]:
    """The group choices a bare run takes (conf/config.yaml's defaults list)."""
    chosen: dict[str, str] = {}
    for entry in OmegaConf.load(conf_dir / "config.yaml").get("defaults", []):
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            for group, choice in dict(entry).items():
                if choice is not None and not str(group).startswith("override"):
                    chosen[str(group)] = str(choice)
    return chosen


def help_text(width: int = 80, conf_dir: Path = CONF_DIR) -> str:
    """The page, every line at most `width` characters (never less than 40), broken between words."""
    width = max(40, width)

    def para(text: str, indent: str = "", first: str = "") -> list[str]:
        return textwrap.wrap(text, width, initial_indent=first or indent, subsequent_indent=indent,
                             break_long_words=False, break_on_hyphens=False)  # fmt: skip

    defaults = _defaults(conf_dir)
    bare = " ".join(
        f"{group}={defaults[group]}" for group in ("host", "model", "experiment", "tracking") if group in defaults
    )
    lines = [*para("python -m orchestrator [key=value ...]   (or: ddtree-orch [key=value ...])"), ""]
    lines += para(
        "Runs speculative-decoding experiments on a GPU host over SSH, with every metric, progress line and "
        "traceback in MLflow. A run validates the config, creates an MLflow run, checks the host, syncs the "
        "worker's code there, launches it detached, and follows its event log into MLflow until it ends."
    )
    lines += ["", *para(f"With no arguments (make run), a run is {bare}: a worker on this machine, the trained "
                        "tiny hybrid pair, a local MLflow store (make ui shows it).")]  # fmt: skip
    lines += ["", *para("Commands (give the same host= and tracking= as the run; <run> is a run id, a unique "
                        "prefix of one as list shows it, or last, the newest you launched from here):")]  # fmt: skip
    column = max(len(example) for example, _ in COMMANDS) + 4
    for example, what in COMMANDS:
        if column + 20 <= width:
            lines += para(what, " " * column, f"  {example:<{column - 2}}")
        else:
            lines += [f"  {example}", *para(what, "      ")]
    lines += ["", "Config groups (group=choice):"]
    for group in sorted(p.name for p in conf_dir.iterdir() if p.is_dir()):
        choices = ", ".join(sorted(p.stem for p in (conf_dir / group).glob("*.yaml")))
        lines += para(choices, "    ", f"  {group}: ")
    lines += [""]
    lines += para("Any key can be set with key=value, e.g. 'decode.tree_budgets=[16,32,64]'; an unknown key is "
                  "refused with the closest valid one. The whole config: --cfg job. Hydra's own page: "
                  "--hydra-help.")  # fmt: skip
    lines += [""]
    lines += para("Results: the MLflow run at the printed address (tracking=local: make ui serves it at "
                  "http://127.0.0.1:5000); the worker's files in host.workdir/runs/<run id>/. The README is "
                  "the manual.")  # fmt: skip
    return "\n".join(lines)
