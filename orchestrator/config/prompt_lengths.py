"""The token count of every prompt a decode will run, where this machine can count them, before launch.

The worker encodes each prompt with the model's tokenizer (its chat template) or, for a model built from a
config, as the conversation's bytes (`remote_worker/prompts.py`). Here the same `encode` runs on the same
prompts (`experiment.prompts`, else the set the checkpoint ships, else the worker's default) wherever the
tokenizer is readable on this machine: a shipped fixture, or a checkpoint on this machine when the host is
this machine. Elsewhere the prompts are counted on the host, before the first one is decoded.

A prompt the decode cannot start from (fewer than two tokens: a committed prefix and the first root) is a
config error naming its file and line; the longest prompt bounds the largest tree budget that fits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config.chat_tokens import plain_chat_tokenizer
from orchestrator.config.checkpoints import local_checkpoint
from orchestrator.config.prompts import resolve_prompts
from remote_worker.prompt_set import DEFAULT_PROMPTS, Prompt, load_prompt_file
from remote_worker.wording import counted

MIN_PROMPT_TOKENS = 2  # the loop's prefill commits all but the last token, which is the first round's root


@dataclass(frozen=True)
class PromptLength:
    prompt_id: str
    where: str  # `file:line`
    tokens: int


class PromptTooShort(ValueError):
    """A prompt with fewer than MIN_PROMPT_TOKENS tokens under the run's model."""


def _prompt_file(experiment: dict[str, Any], checkpoint: Path | None) -> tuple[list[Prompt], str]:
    """The prompts the worker will read (as `ddtree_gdn.prompt_source` chooses them), and their file's name."""
    value = experiment.get("prompts")
    limit = experiment.get("num_prompts")
    if value is not None:
        prompts = resolve_prompts(str(value), experiment.get("datasets_dir"))
        assert prompts is not None
        return (prompts[:limit] if limit else prompts), str(value)
    shipped = checkpoint / "prompts.jsonl" if checkpoint is not None else None
    path = shipped if shipped is not None and shipped.is_file() else DEFAULT_PROMPTS
    return load_prompt_file(path, limit), str(path)


@functools.lru_cache(maxsize=4)  # a sweep checks every job's prompts before the first: one load per model
def _tokenizer(checkpoint: Path) -> Any:
    """The checkpoint's tokenizer: read without torch where it is plain (`chat_tokens`), else as the worker
    reads it."""
    if (plain := plain_chat_tokenizer(checkpoint)) is not None:
        return plain
    import transformers

    return transformers.AutoTokenizer.from_pretrained(checkpoint)


def prompt_lengths(container: dict[str, Any], vocab: int | None) -> list[PromptLength] | None:
    """Every prompt's token count under the run's model, or None where this machine cannot count them (the
    tokenizer is only on the host). Raises PromptTooShort for a prompt the decode cannot start from."""
    model, local = container["model"], container["host"]["kind"] == "local"
    checkpoint = local_checkpoint(model, local)
    if model.get("source") != "config" and (checkpoint is None or not (checkpoint / "tokenizer_config.json").is_file()):
        return None
    if checkpoint is None and (vocab or 0) < 256:
        return None  # the worker refuses such a model itself, naming its vocabulary
    prompts, source = _prompt_file(container["experiment"], checkpoint)
    from remote_worker.prompts import token_ids  # the worker's own encoding, without torch

    tokenizer = _tokenizer(checkpoint) if checkpoint is not None else None
    thinking = bool(container["experiment"].get("enable_thinking", False))
    lengths = []
    for prompt in prompts:
        tokens = len(token_ids(prompt, tokenizer, vocab or 256, thinking))
        where = f"{source}:{prompt.line}" if prompt.line else source
        if tokens < MIN_PROMPT_TOKENS:
            raise PromptTooShort(
                f"experiment.prompts: {where}: prompt {prompt.id!r} is {counted(tokens, 'token')} long "
                f"with model {model.get('name')}'s tokenizer; a decode needs at least {MIN_PROMPT_TOKENS} "
                "(give it more text or leave it out)"
            )
        lengths.append(PromptLength(prompt.id, where, tokens))
    return lengths
