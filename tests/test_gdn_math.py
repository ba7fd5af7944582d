"""Tree Gated DeltaNet against the path-by-path recurrence, on random trees (property-based)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_worker.cache.gdn_math import (
    commit_conv_state,
    commit_state,
    conv_windows,
    recurrent_reference,
    tree_conv,
    tree_delta_rule,
)
from remote_worker.cache.hybrid_cache import CacheLayout, GDNPending, HybridCache
from remote_worker.cache.tree import Tree

# worker: only the worker's dependencies; compat: it touches transformers, so `make test-compat` runs it
# under the oldest supported release too
pytestmark = [pytest.mark.worker, pytest.mark.compat]


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 24) -> Tree:
    n = draw(st.integers(min_value=1, max_value=max_nodes))
    parents = [-1] + [draw(st.integers(min_value=0, max_value=i - 1)) for i in range(1, n)]
    return Tree.from_parents(torch.zeros(n, dtype=torch.long), parents)


def random_inputs(n: int, dtype: torch.dtype, seed: int, heads: int = 3, dk: int = 8, dv: int = 6):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(rand(heads, n, dk), dim=-1) / dk**0.5
    k = F.normalize(rand(heads, n, dk), dim=-1)
    v = rand(heads, n, dv)
    g = -torch.rand(heads, n, generator=gen, dtype=torch.float64) * 2.0
    beta = torch.rand(heads, n, generator=gen, dtype=torch.float64)
    state = rand(heads, dk, dv)
    return [x.to(dtype) for x in (q, k, v, g, beta, state)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    error = (actual.double() - expected.double()).abs().max().item()
    if dtype == torch.float64:
        assert error < 1e-9, error
    else:
        scale = expected.double().abs().max().item()
        assert error / max(scale, 1e-6) < 1e-4, (error, scale)


@settings(max_examples=60, deadline=None)
@given(tree=trees(), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_tree_outputs_equal_the_recurrence_along_each_path(tree: Tree, seed: int, dtype: torch.dtype) -> None:
    q, k, v, g, beta, state = random_inputs(tree.size, dtype, seed)
    result = tree_delta_rule(q, k, v, g, beta, state, tree.ancestor_mask())
    for node in range(tree.size):
        path = tree.path_to(node)
        ref_out, _ = recurrent_reference(q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path], state)
        assert_close(result.out[:, node], ref_out[:, -1], dtype)


@settings(max_examples=60, deadline=None)
@given(tree=trees(), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_commit_equals_the_recurrence_state(tree: Tree, seed: int, dtype: torch.dtype) -> None:
    q, k, v, g, beta, state = random_inputs(tree.size, dtype, seed)
    result = tree_delta_rule(q, k, v, g, beta, state, tree.ancestor_mask())
    last = seed % tree.size
    path = tree.path_to(last)
    _, ref_state = recurrent_reference(q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path], state)
    assert_close(commit_state(state, k, result, path), ref_state, dtype)


def sequential_conv(sequence: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The model's own form: a depthwise causal conv1d over the whole sequence, then SiLU ([T, C] → [T, C])."""
    kernel = weight.shape[1]
    out = F.conv1d(sequence.t()[None], weight[:, None, :], padding=kernel - 1, groups=weight.shape[0])
    return F.silu(out[0, :, : sequence.shape[0]].t())


@settings(max_examples=60, deadline=None)
@given(
    tree=trees(),
    seed=st.integers(0, 2**31 - 1),
    kernel=st.integers(1, 5),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
def test_conv_gather_equals_the_conv_along_each_path(tree: Tree, seed: int, kernel: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    channels = 7
    inputs = torch.randn(tree.size, channels, generator=gen, dtype=torch.float64).to(dtype)
    history = torch.randn(kernel - 1, channels, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(channels, kernel, generator=gen, dtype=torch.float64).to(dtype)
    windows = conv_windows(tree.parents, kernel)
    out, extended = tree_conv(inputs, history, weight, None, windows)
    for node in range(tree.size):
        path = tree.path_to(node)
        sequence = torch.cat([history, inputs[path]])
        assert_close(out[node], sequential_conv(sequence, weight)[-1], dtype)
        committed = commit_conv_state(extended, windows, node)
        assert torch.equal(committed, sequence[len(sequence) - (kernel - 1) :])


def test_chain_is_the_plain_recurrence() -> None:
    q, k, v, g, beta, state = random_inputs(40, torch.float64, seed=7)
    tree = Tree.chain(torch.zeros(40, dtype=torch.long))
    result = tree_delta_rule(q, k, v, g, beta, state, tree.ancestor_mask())
    ref_out, ref_state = recurrent_reference(q, k, v, g, beta, state)
    assert_close(result.out, ref_out, torch.float64)
    assert_close(commit_state(state, k, result, list(range(40))), ref_state, torch.float64)


def test_a_flat_sequence_through_a_tree_is_wrong() -> None:
    """Why the tree form is needed: treating siblings as a sequence gives the second sibling a false history."""
    q, k, v, g, beta, state = random_inputs(3, torch.float64, seed=3)
    tree = Tree.from_parents(torch.zeros(3, dtype=torch.long), [-1, 0, 0])
    exact = tree_delta_rule(q, k, v, g, beta, state, tree.ancestor_mask()).out
    flat, _ = recurrent_reference(q, k, v, g, beta, state)
    assert (exact[:, 2] - flat[:, 2]).abs().max() > 1e-3
    assert torch.allclose(exact[:, :2], flat[:, :2])


def grouped_inputs(n: int, key_heads: int, groups: int, seed: int, dk: int = 5, dv: int = 7):
    """Random inputs with `key_heads` key heads and `groups` value heads per key head (Hv = r·Hk)."""
    q, k, v, g, beta, state = random_inputs(n, torch.float64, seed, heads=key_heads * groups, dk=dk, dv=dv)
    return q[::groups], k[::groups], v, g, beta, state  # value head h reads key head h // r


# (key heads, value heads per key head): the published layouts (Qwen3.5/3.6-27B 16×3, Qwen3-Next 16×2) and
# r ∈ {1, 2, 3, 6} with the two axes unequal, so that reading one for the other fails.
GROUPINGS = [(16, 3), (16, 2), (4, 1), (4, 2), (4, 3), (4, 6), (2, 3), (3, 2), (5, 6)]


@settings(max_examples=60, deadline=None)
@given(tree=trees(), seed=st.integers(0, 2**31 - 1), grouping=st.sampled_from(GROUPINGS))
def test_grouped_value_heads_equal_the_recurrence_with_repeated_keys(
    tree: Tree, seed: int, grouping: tuple[int, int]
) -> None:
    """With fewer key heads than value heads (Qwen3.5/3.6: 16 and 48), value head h reads key head h // r,
    as the model's repeat_interleave does; outputs and the committed state must equal the recurrence's."""
    key_heads, groups = grouping
    q, k, v, g, beta, state = grouped_inputs(tree.size, key_heads, groups, seed)
    result = tree_delta_rule(q, k, v, g, beta, state, tree.ancestor_mask())
    q_rep, k_rep = q.repeat_interleave(groups, dim=0), k.repeat_interleave(groups, dim=0)
    last = seed % tree.size
    for node in {0, last, tree.size - 1}:
        path = tree.path_to(node)
        ref_out, ref_state = recurrent_reference(
            q_rep[:, path], k_rep[:, path], v[:, path], g[:, path], beta[:, path], state
        )
        assert_close(result.out[:, node], ref_out[:, -1], torch.float64)
        assert_close(commit_state(state, k, result, path), ref_state, torch.float64)


@settings(max_examples=40, deadline=None)
@given(tree=trees(), seed=st.integers(0, 2**31 - 1), grouping=st.sampled_from(GROUPINGS))
def test_the_caches_grouped_state_commits_the_recurrence(tree: Tree, seed: int, grouping: tuple[int, int]) -> None:
    """The same through `HybridCache`: two GDN layers verified from the cache's own grouped state
    ([layers, Hk, d_k, r, d_v], read as [Hk, r, d_k, d_v]) and committed together by `commit`."""
    key_heads, groups = grouping
    dk, dv, kernel, layers = 5, 7, 4, 2
    conv_dim = 2 * key_heads * dk + key_heads * groups * dv
    layout = CacheLayout(torch.device("cpu"), torch.float64, None, (kernel - 1, conv_dim, key_heads, groups, dk, dv))
    cache = HybridCache(["gdn"] * layers, layout)
    ctx = cache.begin(tree, torch.device("cpu"), torch.float64)
    starts, expected = [], []
    last = seed % tree.size
    path = tree.path_to(last)
    for slot in range(layers):
        q, k, v, g, beta, state = grouped_inputs(tree.size, key_heads, groups, seed + slot)
        cache.recurrent[slot] = state.unflatten(0, (key_heads, groups)).transpose(1, 2)  # the cache's layout
        _, grouped_state = cache.gdn_state(slot)
        result = tree_delta_rule(q, k, v, g, beta, grouped_state, ctx.mask, ctx.ancestors, ctx.decay_bias)
        extended = torch.randn(kernel - 1 + tree.size, conv_dim, dtype=torch.float64)
        cache.pending[slot] = GDNPending(extended=extended, keys=k, result=result)
        q_rep, k_rep = q.repeat_interleave(groups, dim=0), k.repeat_interleave(groups, dim=0)
        _, ref_state = recurrent_reference(q_rep[:, path], k_rep[:, path], v[:, path], g[:, path], beta[:, path], state)
        starts.append(extended)
        expected.append(ref_state)
    cache.commit(path)
    for slot in range(layers):
        conv, committed = cache.gdn_state(slot)
        assert_close(committed.flatten(0, 1), expected[slot], torch.float64)  # [Hv, d_k, d_v]
        assert torch.equal(conv, commit_conv_state(starts[slot], conv_windows(tree.parents, kernel), last))
