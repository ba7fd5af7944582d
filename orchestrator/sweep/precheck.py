"""Every job's prompts, checked before a sweep's first job starts.

A paper sweep's datasets are read here when the sweep starts (each once: `paper_datasets` keeps what it
read), every job's prompt file is built and read back as the worker reads it, and its prompts are counted
with the model's tokenizer where this machine has it, all as the job itself will check them
(`config/validation.py`). A set that is missing or unreadable would otherwise be found at its job's turn,
after the jobs before it had spent their GPU time: here it is one line, with the command that fetches it,
and nothing runs. Other config mistakes stay the job's own: its row in the sweep's table says them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from orchestrator.config.validation import PromptsError, resolve_config


@dataclass(frozen=True)
class PromptProblem:
    """One reason a sweep cannot start, and the jobs (by number) it stops."""

    message: str
    jobs: tuple[int, ...]

    def line(self) -> str:
        which = ", ".join(f"#{n}" for n in self.jobs)
        return f"config error: job{'s' * (len(self.jobs) > 1)} {which}: {self.message}"


def prompt_problems(master: DictConfig, job_overrides: Sequence[Sequence[str]]) -> list[PromptProblem]:
    """What stops each job's prompts, one entry per distinct message (a missing set stops both temperatures),
    in job order. Each job's config is composed as the launcher will compose it."""
    loader = GlobalHydra.instance().config_loader()
    saved = HydraConfig.instance().cfg
    found: dict[str, list[int]] = {}
    try:
        for number, overrides in enumerate(job_overrides):
            try:
                job = loader.load_sweep_config(master, list(overrides))
                HydraConfig.instance().set_config(job)  # `${hydra:...}` in the job's values resolves as in the job
                with open_dict(job):
                    del job["hydra"]
                resolve_config(job)
            except PromptsError as exc:
                found.setdefault(str(exc), []).append(number)
            except Exception:  # noqa: BLE001 - any other mistake is the job's to report, in its row
                continue
    finally:
        HydraConfig.instance().cfg = saved  # type: ignore[assignment]
    return [PromptProblem(message, tuple(jobs)) for message, jobs in found.items()]
