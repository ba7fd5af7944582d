"""The fixed-shape mixture of experts (`remote_worker.models.moe`) against transformers' own block, its naive
reference: random routings, ties in the router's scores, float32 and float64, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from remote_worker.models.mlp import module_reference
from remote_worker.models.moe import GATHER_BYTES, GATHERED, SparseMoE, is_sparse_moe
from tests.rounding import rounding_bound
from tests.tiny_models import tiny

# worker: only the worker's dependencies; compat: it touches transformers, so `make test-compat` runs it
# under the oldest supported release too
pytestmark = [pytest.mark.worker, pytest.mark.compat]


def moe_blocks(dtype: str, kind: str = "qwen3_next") -> list[torch.nn.Module]:
    """Qwen3-Next's sparse blocks (tiny_qwen3_next: its router's `norm_topk_prob`), or Qwen3.5/3.6-MoE's
    (the architecture of Qwen3.6-35B-A3B: a router that always renormalises), at tiny widths."""
    if kind == "qwen3_next":
        target, _ = tiny("tiny_qwen3_next", dtype)
        return [layer.mlp for layer in target.layers]
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(
        hidden_size=40, moe_intermediate_size=20, shared_expert_intermediate_size=36, num_experts=16,
        num_experts_per_tok=8,
    )  # fmt: skip
    torch.manual_seed(0)
    blocks = [Qwen3_5MoeSparseMoeBlock(config).to(getattr(torch, dtype)) for _ in range(2)]
    for block in blocks:
        for parameter in block.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
    return blocks


def with_ties(mlp: torch.nn.Module, seed: int) -> None:
    """Router rows copied onto others: those experts' scores are equal for every token."""
    generator = torch.Generator().manual_seed(seed)
    weight = mlp.gate.weight
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype))
        source, target = torch.randperm(weight.shape[0], generator=generator)[:2].tolist()
        weight[target] = weight[source]


def bound(mlp: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> float:
    """Two matmuls and a k-term combine, each summing at most max(hidden, intermediate, k) terms."""
    width = max(x.shape[-1], mlp.experts.down_proj.shape[-1], mlp.gate.top_k)
    return rounding_bound(x.dtype, 4, width, out.abs().max().item())


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tokens", [1, 9, 2 * GATHERED + 3])
def test_the_fixed_shape_block_is_the_modules_block(kind: str, dtype: str, tokens: int) -> None:
    """Same routing as the module's router (ties broken the same way: the same top-k of the same scores), and
    outputs equal within the rounding of two evaluation orders."""
    for index, mlp in enumerate(moe_blocks(dtype, kind)):
        assert is_sparse_moe(mlp)
        for seed in range(4):
            if seed % 2:
                with_ties(mlp, seed + 10 * index)
            x = torch.randn(tokens, mlp.gate.weight.shape[1], generator=torch.Generator().manual_seed(seed))
            x = x.to(getattr(torch, dtype))
            moe = SparseMoE(mlp)
            weights, experts = moe.route(x)
            if x.dtype == torch.float32:  # the module's own router
                _, expected_weights, expected_experts = mlp.gate(x)
                assert torch.equal(experts, expected_experts) and torch.equal(weights, expected_weights)
            with torch.no_grad():
                ours, reference = moe(x), module_reference(mlp, x)
            error = (ours - reference).abs().max().item()
            assert error <= bound(mlp, x, reference), (index, seed, error)


def test_the_block_compiles_into_one_graph_and_agrees_with_eager() -> None:
    mlp = moe_blocks("float32")[0]
    moe = SparseMoE(mlp)
    x = torch.randn(9, mlp.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(moe.__call__)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    with torch.no_grad():
        compiled = torch.compile(moe.__call__, fullgraph=True, dynamic=False)(x)
        eager = moe(x)
    assert (compiled - eager).abs().max().item() <= bound(mlp, x, eager)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_eager_loop_over_experts_is_the_gathered_path(dtype: str) -> None:
    """Run eagerly the block loops over the experts the routing hit (`looped`); a graph gathers each
    assignment's weights (`gathered`): the same outputs within the rounding of two evaluation orders, every
    assignment in place (an expert no token chose, one chosen by every token)."""
    for mlp in moe_blocks(dtype, "qwen3_5_moe"):
        moe = SparseMoE(mlp)
        for tokens in (1, 2 * GATHERED + 3):
            x = torch.randn(tokens, mlp.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
            x = x.to(getattr(torch, dtype))
            _, experts = moe.route(x)
            rows, chosen = x.repeat_interleave(moe.top_k, dim=0), experts.flatten()
            skewed = torch.where(chosen % 3 == 0, 0, chosen)  # expert 0 far above its share, some none
            for picked in (chosen, skewed):
                looped, gathered = moe.looped(rows, picked), moe.gathered(rows, picked)
                assert looped.shape == gathered.shape
                assert (looped - gathered).abs().max().item() <= bound(mlp, x, gathered), (tokens, dtype)
            # eagerly, a few tokens' copies are the gathered path (cheaper than the loop's host read), more the loop
            per_assignment = (moe.gate_up[0].numel() + moe.down[0].numel()) * x.element_size()
            small = rows.shape[0] * per_assignment <= GATHER_BYTES
            assert small == (tokens == 1)
            assert torch.equal(moe.expert_outputs(x, experts), (moe.gathered if small else moe.looped)(rows, chosen))


def test_the_grouped_matmul_path_is_the_gathered_path() -> None:
    """`torch._grouped_mm` runs eagerly on a CPU in float32 (under compile, on a GPU, bfloat16 only): the
    sorted-by-expert path computes what the gathered one does."""
    mlp = moe_blocks("float32")[1]
    moe = SparseMoE(mlp)
    x = torch.randn(13, mlp.gate.weight.shape[1], generator=torch.Generator().manual_seed(5))
    _, experts = moe.route(x)
    rows, chosen = x.repeat_interleave(moe.top_k, dim=0), experts.flatten()
    gathered, grouped = moe.gathered(rows, chosen), moe.grouped(rows, chosen)
    assert (grouped - gathered).abs().max().item() <= bound(mlp, x, gathered)
