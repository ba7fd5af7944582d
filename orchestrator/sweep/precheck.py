"""Every job's prompts, checked before a sweep's first job starts.

A paper sweep's datasets are read here when the sweep starts (each once: `paper_datasets` keeps what it
read), every job's prompt file is built and read back as the worker reads it, and its prompts are counted
with the model's tokenizer where this machine has it, all as the job itself will check them
(`config/validation.py`). A set that is missing or unreadable would otherwise be found at its job's turn,
after the jobs before it had spent their GPU time: here it is one line, with the command that fetches it,
and nothing runs. Other config mistakes stay the job's own: its row in the sweep's table says them, except in
a dry run (`sweep.dry_run=true`), where no job will run to say them: there every mistake is reported here.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from orchestrator.config.validation import ConfigError, PromptsError, resolve_config


class JobComposer:
    """Each job's config as the launcher composes it (`load_sweep_config`), composed in full once per set of
    config-group choices: the jobs of a grid mostly differ in plain values (`experiment.prompts=gsm8k`,
    `decode.temperature=1`), and Hydra reads every YAML file again for each job (0.3 s a job; 80 shards, 25 s).
    A plain value is applied to a copy of the composed config the way Hydra applies it, after its defaults
    (`_apply_overrides_to_config`); anything else (a group, a Hydra setting, a dict, an append or deletion, a
    sweep) is part of what is composed in full. `tests/test_paper_docs.py` ties both ways together."""

    def __init__(self, master: DictConfig) -> None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.master = master
        self.loader = GlobalHydra.instance().config_loader()
        self.parser = OverridesParser.create()
        self.composed: dict[tuple[str, ...], DictConfig] = {}

    def _plain(self, override: Any) -> bool:
        key = override.key_or_group
        return (
            "." in key
            and not any(mark in key for mark in "/@")
            and not override.is_hydra_override()
            and not override.is_sweep_override()
            and not override.is_add()
            and not override.is_force_add()
            and not override.is_delete()
            and not isinstance(override.value(), dict)
            and not self.loader.repository.group_exists(key)  # type: ignore[attr-defined]
        )

    def job(self, overrides: Sequence[str]) -> DictConfig:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        parsed = self.parser.parse_overrides(list(overrides))
        plain = [o for o in parsed if self._plain(o)]
        rest = tuple(o.input_line for o in parsed if not self._plain(o))
        if rest not in self.composed:
            self.composed[rest] = self.loader.load_sweep_config(self.master, list(rest))
        job = copy.deepcopy(self.composed[rest])
        ConfigLoaderImpl._apply_overrides_to_config(plain, job)
        return job


@dataclass(frozen=True)
class PromptProblem:
    """One reason a sweep cannot start, and the jobs (by number) it stops."""

    message: str
    jobs: tuple[int, ...]

    def line(self) -> str:
        """`config error: jobs #6, #7: …`; three or more in a row as a range (`#0–#79`), so 80 jobs stay one line."""
        runs: list[list[int]] = []
        for n in sorted(set(self.jobs)):
            if runs and n == runs[-1][-1] + 1:
                runs[-1].append(n)
            else:
                runs.append([n])
        which = ", ".join(f"#{r[0]}–#{r[-1]}" if len(r) > 2 else ", ".join(f"#{n}" for n in r) for r in runs)
        return f"config error: job{'s' * (len(self.jobs) > 1)} {which}: {self.message}"


def prompt_problems(
    master: DictConfig, job_overrides: Sequence[Sequence[str]], every_mistake: bool = False
) -> list[PromptProblem]:
    """What stops each job's prompts, one entry per distinct message (a missing set stops both temperatures),
    in job order. Each job's config is composed as the launcher will compose it. With `every_mistake`, any
    config mistake of a job is one too (a dry run, where no job runs to report its own)."""
    composer = JobComposer(master)
    saved = HydraConfig.instance().cfg
    found: dict[str, list[int]] = {}
    try:
        for number, overrides in enumerate(job_overrides):
            try:
                _check(composer.job(overrides))
            except PromptsError as exc:
                found.setdefault(str(exc), []).append(number)
            except Exception as exc:  # noqa: BLE001 - any other mistake is the job's to report, in its row
                if every_mistake:
                    found.setdefault(_one_line(exc), []).append(number)
    finally:
        HydraConfig.instance().cfg = saved  # type: ignore[assignment]
    return [PromptProblem(message, tuple(jobs)) for message, jobs in found.items()]


def pool_problems(master: DictConfig, job_overrides: Sequence[str], pool: Sequence[str]) -> list[PromptProblem]:
    """For a dry run: each host of `sweep.hosts` composed into the first job's config and checked, as a job
    checks its pool before it claims a GPU (`sweep/host_pool.py`); one problem per host that fails."""
    from hydra.errors import MissingConfigException

    loader = GlobalHydra.instance().config_loader()
    saved = HydraConfig.instance().cfg
    found = []
    try:
        for name in pool:
            try:
                _check(loader.load_sweep_config(master, [*job_overrides, f"host={name}"]))
            except MissingConfigException:
                found.append(PromptProblem(f"sweep.hosts: no host config named {name!r} (conf/host/{name}.yaml)", (0,)))
            except Exception as exc:  # noqa: BLE001 - every mistake is the dry run's to report
                found.append(PromptProblem(f"sweep.hosts: {name}: {_one_line(exc)}", (0,)))
    finally:
        HydraConfig.instance().cfg = saved  # type: ignore[assignment]
    return found


def _check(job: DictConfig) -> None:
    """A composed job's config checked as the job will check it; the caller restores HydraConfig after."""
    HydraConfig.instance().set_config(job)  # `${hydra:...}` in the job's values resolves as in the job
    with open_dict(job):
        del job["hydra"]
    resolve_config(job)


def _one_line(exc: Exception) -> str:
    """A config mistake's own line; anything else named by its type, on one line."""
    message = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    return " ".join(message.split())
