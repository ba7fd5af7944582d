"""A byte-level tokenizer saved in the Hugging Face format, so the fixtures load like real checkpoints.

Token id b is the byte b (0-255); then end-of-text, the drafter's mask token and padding. The chat template
concatenates the messages' contents: a prompt is raw code to continue.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

EOS_ID, MASK_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 260  # the specials, and one spare id to keep the size even
SPECIALS = {"<|endoftext|>": EOS_ID, "<|mask|>": MASK_ID, "<|pad|>": PAD_ID, "<|unused|>": 259}
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab.update(SPECIALS)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", mask_token="<|mask|>", pad_token="<|pad|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
