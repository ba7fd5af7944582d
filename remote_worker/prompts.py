"""Prompt sets: a JSONL file of chat turns, one conversation a line, turned into token ids.

With a tokenizer (real checkpoints) the model's chat template is applied. Tiny models built from a config
have none; their prompts are the conversation's UTF-8 bytes, which fit any vocabulary of 256 or more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "prompts_default.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]


def load_prompts(path: str | None, limit: int | None) -> list[Prompt]:
    file = Path(path) if path else DEFAULT_PROMPTS
    if not file.is_file():
        raise FileNotFoundError(f"prompt set {file} does not exist (experiment.prompts)")
    prompts = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw: dict[str, Any] = json.loads(line)
            messages = raw["messages"]
            if not messages or not all({"role", "content"} <= set(m) for m in messages):
                raise ValueError("each message needs a role and a content")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{file}:{number}: not a chat turn line ({exc})") from exc
        prompts.append(Prompt(id=str(raw.get("id", f"prompt-{number}")), messages=messages))
    if not prompts:
        raise ValueError(f"prompt set {file} is empty")
    return prompts[:limit] if limit else prompts


def encode(prompt: Prompt, tokenizer: Any | None, vocab_size: int) -> torch.Tensor:
    if tokenizer is not None:
        ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.tensor(ids, dtype=torch.long).flatten()
    if vocab_size < 256:
        raise ValueError(f"a model without a tokenizer needs a vocabulary of at least 256 (has {vocab_size})")
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in prompt.messages) + "<assistant>"
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode_text(tokens: list[int], tokenizer: Any | None) -> str:
    if tokenizer is not None:
        return tokenizer.decode(tokens)
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
