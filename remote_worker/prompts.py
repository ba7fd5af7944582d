"""Prompts turned into token ids, and generated ids back into text.

With a tokenizer (real checkpoints) the model's chat template is applied, with `enable_thinking` passed
through (templates that do not know it ignore it). Tiny models built from a config have none; their
prompts are the conversation's UTF-8 bytes, which fit any vocabulary of 256 or more.

The orchestrator counts every prompt's tokens before a launch (`token_ids`) without importing torch, which
would cost each job of a sweep seconds of CPU; only `encode`, the worker's, makes a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from remote_worker.prompt_set import Prompt

if TYPE_CHECKING:
    import torch


def token_ids(prompt: Prompt, tokenizer: Any | None, vocab_size: int, enable_thinking: bool = False) -> list[int]:
    """The prompt as the model reads it: the chat template's ids, or the conversation's UTF-8 bytes."""
    if tokenizer is not None:
        ids = tokenizer.apply_chat_template(
            prompt.messages, add_generation_prompt=True, tokenize=True, enable_thinking=enable_thinking
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]
    if vocab_size < 256:
        raise ValueError(f"a model without a tokenizer needs a vocabulary of at least 256 (has {vocab_size})")
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in prompt.messages) + "<assistant>"
    return list(text.encode("utf-8"))


def encode(prompt: Prompt, tokenizer: Any | None, vocab_size: int, enable_thinking: bool = False) -> torch.Tensor:
    """`token_ids` as a tensor [n] of int64."""
    import torch

    return torch.tensor(token_ids(prompt, tokenizer, vocab_size, enable_thinking), dtype=torch.long)


def decode_text(tokens: list[int], tokenizer: Any | None, skip_special: bool = False) -> str:
    """The text of `tokens`; `skip_special`: without the tokenizer's special tokens (an answer that becomes the
    next turn's assistant message, where the chat template adds its own)."""
    if tokenizer is not None:
        return tokenizer.decode(tokens, skip_special_tokens=skip_special)
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
