"""Train a tiny target on byte-level Python source, then a DFlash draft against the frozen target.

The draft learns the target's own greedy continuations of training-corpus prefixes: for an anchor c of
such a sequence it sees the target's features of the positions before c and the token at c, and must
predict the tokens after it, exactly the question `propose` answers while decoding.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from remote_worker.models.dflash import DFlashDraft, draft_config
from remote_worker.models.target import TargetModel
from training.corpus import windows
from training.draft_forward import block_logits
from training.tokenizer import EOS_ID, MASK_ID, PAD_ID, VOCAB_SIZE

Log = Callable[[str], None]


def _schedule(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _optimise(
    parameters: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    step_loss: Callable[[], torch.Tensor],
    steps: int,
    lr: float,
    warmup: int,
    name: str,
    log: Log,
) -> None:
    """The loop both trainings share: schedule, one loss, clipped step, a log line every 50 steps."""
    started = time.monotonic()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _schedule(step, steps, lr, warmup)
        loss = step_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"{name}: step {step}/{steps} loss {loss.item():.3f} ({time.monotonic() - started:.0f}s)")


def target_config(arch: str, hidden: int, layers: list[str]) -> transformers.PretrainedConfig:
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": len(layers),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "bos_token_id": None,
    }
    cls = getattr(transformers, arch)
    if arch == "Qwen3_5ForCausalLM":
        common |= {
            "layer_types": layers,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": hidden // 4,
            "linear_value_head_dim": hidden // 4,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
        }
    return cls.config_class(**common)


def train_target(
    arch: str,
    config: transformers.PretrainedConfig,
    data: torch.Tensor,
    steps: int,
    log: Log,
    seq_len: int = 128,
    batch: int = 24,
    lr: float = 3e-3,
) -> transformers.PreTrainedModel:
    """Next-byte prediction on seeded random windows of `data`: the same steps give the same model."""
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(0)

    def step_loss() -> torch.Tensor:
        inputs = windows(data, seq_len, batch, generator)
        return model(input_ids=inputs, labels=inputs).loss

    _optimise(list(model.parameters()), optimizer, step_loss, steps, lr, 30, arch, log)
    return model.eval()


@torch.no_grad()
def continuations(
    model: transformers.PreTrainedModel, prefixes: torch.Tensor, new_tokens: int, batch: int = 64
) -> list[torch.Tensor]:
    """The target's greedy continuation of each prefix (the prefix included), generated in batches."""
    sequences = []
    for start in range(0, prefixes.shape[0], batch):
        out = model.generate(
            prefixes[start : start + batch],
            attention_mask=torch.ones_like(prefixes[start : start + batch]),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=PAD_ID,
        )
        sequences.extend(out)
    return sequences


def draft_values(hidden: int, block_size: int, target_layer_ids: list[int], target_layers: int) -> dict[str, Any]:
    """The draft's config.json. `model_type` and `num_target_layers` are there for the reference draft class,
    which is built through AutoConfig and reads them; our loader needs neither."""
    return {
        "model_type": "qwen3",
        "num_target_layers": target_layers,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "max_position_embeddings": 2048,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": target_layer_ids, "mask_token_id": MASK_ID},
    }


def train_draft(
    target: TargetModel,
    values: dict[str, Any],
    sequences: list[torch.Tensor],
    prefix_len: int,
    steps: int,
    log: Log,
    anchors_per_sequence: int = 32,
    batch: int = 8,
    lr: float = 2e-3,
) -> DFlashDraft:
    torch.manual_seed(0)
    draft = DFlashDraft(draft_config(values)).train()
    size = draft.block_size
    with torch.no_grad():  # the frozen target's features of every sequence, once
        features = [target.prefill(target.new_cache(), seq, draft.feature_layers) for seq in sequences]
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)

    def step_loss() -> torch.Tensor:
        loss = torch.zeros(())
        for index in torch.randint(0, len(sequences), (batch,), generator=generator).tolist():
            tokens = sequences[index]
            # Anchors inside the target's continuation, with a whole block of labels after them.
            anchors = torch.randint(
                prefix_len - 1, tokens.shape[0] - size, (anchors_per_sequence,), generator=generator
            )
            logits = block_logits(draft, features[index], tokens, anchors, target.embed, target.head)
            labels = tokens[anchors[:, None] + torch.arange(1, size)[None]]
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return loss / batch

    _optimise(list(draft.parameters()), optimizer, step_loss, steps, lr, 20, "draft", log)
    return draft.eval()


def save_draft(draft: DFlashDraft, values: dict[str, Any], folder: Path) -> None:
    """A DFlash checkpoint directory as `load_draft` reads it (bfloat16 weights, to keep fixtures small)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items() if "rotary" not in k}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], **values}, indent=1) + "\n")
