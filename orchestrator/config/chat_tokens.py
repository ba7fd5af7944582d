"""A checkpoint's chat template and tokenizer, read for counting prompt tokens without importing torch.

`transformers.AutoTokenizer` imports torch and transformers' model machinery (about 4 s of CPU) before it
reads a file; the orchestrator paid that on every run of a model with a tokenizer, only to count prompt
tokens. For the plain case, a tokenizer saved whole in `tokenizer.json` by the generic fast class
(`TokenizersBackend`, `PreTrainedTokenizerFast`) and one chat template, the same ids come from transformers'
own template renderer (`render_jinja_template`, which needs no torch) and the `tokenizers` library that class
wraps: `apply_chat_template(tokenize=True)` renders the template with the named special tokens and encodes the
text with `add_special_tokens=False`. Anything else (a model-specific tokenizer class that rebuilds its
tokenizer, several templates, a separate special-tokens file) is read by `AutoTokenizer`, as the worker reads
it. `tests/test_chat_tokens.py` ties the two on the shipped tokenizers and a Qwen-style template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The classes that load tokenizer.json as it is (no vocabulary rebuilt, no pre-tokenizer patched at load).
GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens a template sees (`{{ eos_token }}`).
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTokenizer:
    """What `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` reads."""

    template: str
    special_tokens: dict[str, str]
    tokenizer: Any  # tokenizers.Tokenizer

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool, **kwargs: Any
    ) -> list[int]:
        """The ids transformers' tokenizer gives for the same call (the subset `remote_worker.prompts` makes)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        assert tokenize, "only token ids are counted here"
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )
        return self.tokenizer.encode(rendered[0], add_special_tokens=False).ids


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def plain_chat_tokenizer(checkpoint: Path) -> ChatTokenizer | None:
    """The checkpoint's tokenizer read without transformers' model machinery, or None where it is not the plain
    case this module covers (then AutoTokenizer reads it)."""
    try:
        config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_CLASSES:
        return None
    if (checkpoint / "special_tokens_map.json").exists() or (checkpoint / "additional_chat_templates").exists():
        return None
    template_file = checkpoint / "chat_template.jinja"  # the saved file wins over the config's field
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    if not isinstance(template, str) or not (checkpoint / "tokenizer.json").is_file():
        return None
    import tokenizers

    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    except Exception:  # noqa: BLE001 (tokenizers raises its own Exception subclass): AutoTokenizer says why
        return None
    named = {name: _token_text(config.get(name)) for name in NAMED_TOKENS}
    return ChatTokenizer(template, {k: v for k, v in named.items() if v is not None}, tokenizer)
