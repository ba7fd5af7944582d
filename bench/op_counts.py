"""Operations per decode round, counted (deterministic: a gate where timings are noise).

The models have the real layer pattern at tiny widths: `hybrid` is 64 layers like Qwen3.6-27B (three Gated
DeltaNet layers then one gated full-attention layer, 16 times), `dense` 64 Qwen3 full-attention layers.
After a 256-token prefill, one round is counted: verifying a 1-node tree (an AR step) and a 64-node
DDTree-shaped tree, and committing a 6-node path of the latter. Beside it, the model's own eager decode
step (transformers' forward of one token with its own cache, torch fallbacks) on the same weights.

Compute operations are counted on the CPU; host→device copies by running the same round on the `meta`
device, where every operation that takes a host tensor and gives a device one would be a copy on a GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers

from remote_worker.cache.tree import Tree
from remote_worker.decoding.tree_build import best_first_tree
from remote_worker.models.target import TargetModel
from remote_worker.op_count import count_operations

TINY_WIDTHS = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}
GDN_WIDTHS = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
LAYERS = 64
PREFILL = 256


def build(kind: str, device: str | torch.device = "cpu", layers: int = LAYERS) -> Any:
    """A seeded float32 model of `kind` ('hybrid' or 'dense') with the real layer count at tiny widths."""
    if kind == "hybrid":
        pattern = ["linear_attention"] * 3 + ["full_attention"]
        config = transformers.Qwen3_5TextConfig(
            num_hidden_layers=layers, layer_types=pattern * (layers // 4), **GDN_WIDTHS, **TINY_WIDTHS
        )
        cls = transformers.Qwen3_5ForCausalLM
    else:
        config = transformers.Qwen3Config(num_hidden_layers=layers, **TINY_WIDTHS)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    return model.eval()


def _tree(nodes: int, vocab: int) -> Tree:
    """A DDTree-shaped tree: best-first over peaked per-position distributions, 15 positions deep."""
    generator = torch.Generator().manual_seed(nodes)
    log_probs = torch.log_softmax(torch.randn(15, vocab, generator=generator) * 3, dim=-1)
    return best_first_tree(1, log_probs, budget=nodes - 1).tree


def _deepest_path(tree: Tree, length: int) -> list[int]:
    node = max(i for i in range(tree.size) if int(tree.depths[i]) <= length - 1)
    return tree.path_to(node)


@dataclass(frozen=True)
class RoundCounts:
    model: str
    verify_1: int  # compute operations verifying a 1-node tree (an AR step)
    verify_64: int  # ... a 64-node tree
    commit: int  # ... committing a 6-node path of the 64-node tree
    host_copies_per_round: int  # host→device copies of a 64-node verify and its commit
    host_copies_verify: int
    host_copies_commit: int
    eager_step: int  # the model's own decode step (transformers' forward of one token)
    top_verify: list[tuple[str, int]]


def _round(model: Any, device: str, tree: Tree, path: list[int]) -> tuple[Any, Any, Any]:
    target = TargetModel(model)
    cache = target.new_cache()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.embed.num_embeddings, (PREFILL,), generator=generator)
    target.prefill(cache, prompt.to(device))
    cache.reserve(PREFILL + 2 * tree.size)
    one = Tree.chain(torch.tensor([3]))
    target.verify(cache, one)  # warm-up: lazily built buffers are not a round's cost
    verify_1 = count_operations(lambda: target.verify(cache, one))
    verify = count_operations(lambda: target.verify(cache, tree))
    commit = count_operations(lambda: cache.commit(path))
    return verify_1, verify, commit


def _eager_step(model: Any) -> int:
    """transformers' own forward of one token after the same prefill, with its own cache."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, PREFILL), generator=generator)
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
    cache = out.past_key_values
    token = torch.tensor([[5]])
    position = torch.tensor([[PREFILL]])
    return count_operations(
        lambda: model(input_ids=token, past_key_values=cache, use_cache=True, position_ids=position)
    ).compute


def host_copies(kind: str, layers: int = LAYERS) -> tuple[int, int]:
    """Host→device copies of (a 64-node verify, its commit), on the `meta` device: no GPU needed."""
    model = build(kind, "meta", layers)
    tree = _tree(64, model.config.vocab_size)
    _, verify, commit = _round(model, "meta", tree, _deepest_path(tree, 6))
    return verify.host_copies, commit.host_copies


def round_counts(kind: str, layers: int = LAYERS, eager: bool = True) -> RoundCounts:
    model = build(kind, "cpu", layers)
    tree = _tree(64, model.config.vocab_size)
    path = _deepest_path(tree, 6)
    verify_1, verify, commit = _round(model, "cpu", tree, path)
    copies = host_copies(kind, layers)
    return RoundCounts(
        model=f"{kind} ({layers} layers, tiny widths)",
        verify_1=verify_1.compute,
        verify_64=verify.compute,
        commit=commit.compute,
        host_copies_per_round=sum(copies),
        host_copies_verify=copies[0],
        host_copies_commit=copies[1],
        eager_step=_eager_step(model) if eager else 0,
        top_verify=verify.top(8),
    )


def op_count_figures() -> list[dict[str, Any]]:
    return [asdict(round_counts(kind)) for kind in ("hybrid", "dense")]


if __name__ == "__main__":
    import json

    print(json.dumps(op_count_figures(), indent=1))
