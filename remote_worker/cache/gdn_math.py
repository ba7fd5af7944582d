"""Gated DeltaNet over a tree, exactly.

Per value head, with committed state S [d_k, d_v], the recurrence along a sequence is

    S_t = exp(g_t) S_{t-1} + k_t u_tᵀ,   u_t = beta_t (v_t - exp(g_t) S_{t-1}ᵀ k_t),   o_t = S_tᵀ q_t.

Unrolled from the committed state, with c_t the log-decay summed from the root to t,
S_t = exp(c_t) S + Σ_{j ≤ t} exp(c_t - c_j) k_j u_jᵀ, and the u solve a unit lower-triangular system.
On a tree "j ≤ t" becomes "j is t or an ancestor of t" (the mask A); row t of the solve touches only
t's ancestors, so every node gets exactly the output of the recurrence run along its own root path.
`recurrent_reference` is that path-by-path recurrence, kept beside the fast form and tied to it by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TreeDeltaResult:
    out: torch.Tensor  # [Hv, n, d_v] per-node outputs
    u: torch.Tensor  # [Hv, n, d_v] the per-node deltas, reused by commit
    c: torch.Tensor  # [Hv, n] log-decay summed along each node's root path


def tree_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    mask: torch.Tensor,
    ancestors: torch.Tensor | None = None,
    decay_bias: torch.Tensor | None = None,
) -> TreeDeltaResult:
    """All nodes of a tree at once. q, k: [Hk, n, d_k] (already normalised, q scaled); v: [Hv, n, d_v];
    g, beta: [Hv, n]; state: [Hv, d_k, d_v] or grouped [Hk, r, d_k, d_v]; mask: [n, n] ancestor-or-self
    (nodes in topological order).

    Value head h reads key head h // r (Hv = r·Hk, as the model's `repeat_interleave`): the key products are
    computed once per key head and broadcast, never repeated. A state stored as [Hk, d_k, r, d_v] (the
    cache's layout; pass its [Hk, r, d_k, d_v] transpose) is read by one matmul per key head with no copy.
    `ancestors` (the mask as 0/1 in g's dtype) and `decay_bias` (0 on the mask, -inf off it) are the same
    for every layer of a round; pass them in."""
    hk, hv, dk, dv = k.shape[0], v.shape[0], k.shape[-1], v.shape[-1]
    r = hv // hk
    if ancestors is None:
        ancestors = mask.to(g.dtype)
    if decay_bias is None:
        decay_bias = ancestors.log()

    def grouped(x: torch.Tensor) -> torch.Tensor:  # [Hv, ...] -> [Hk, r, ...]
        return x.unflatten(0, (hk, r))

    def times_state(x: torch.Tensor) -> torch.Tensor:  # [Hk, n, d_k] -> xᵀS per value head [Hk, r, n, d_v]
        return (x @ state_by_key).unflatten(-1, (r, dv)).transpose(1, 2)

    state_by_key = (state if state.dim() == 4 else grouped(state)).transpose(1, 2).reshape(hk, dk, r * dv)
    c = g @ ancestors.t()  # c_i = Σ_{j ancestor-or-self of i} g_j
    # D[h, i, j] = exp(c_i - c_j) on the mask, 0 off it (the -inf lands before exp, so nothing overflows)
    decay = grouped((c[:, :, None] - c[:, None, :] + decay_bias).exp())  # [Hk, r, n, n]
    growth = grouped(c.exp())[..., None]  # [Hk, r, n, 1]
    b = grouped(beta)[..., None]
    # Unit lower-triangular system: the solve reads only the strict lower triangle (decay is 0 above it).
    system = (k @ k.transpose(1, 2))[:, None] * decay * b
    rhs = b * torch.addcmul(grouped(v), growth, times_state(k), value=-1)  # beta (v - e^c Sᵀk)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = torch.addcmul(((q @ k.transpose(1, 2))[:, None] * decay) @ u, growth, times_state(q))
    return TreeDeltaResult(out=out.flatten(0, 1), u=u.flatten(0, 1), c=c)


def commit_state(
    state: torch.Tensor,
    k: torch.Tensor,
    result: TreeDeltaResult,
    path: list[int] | torch.Tensor,
    grouped: bool = False,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The state after the accepted path (root first): exp(c_m) S + Σ_j exp(c_m - c_j) k_j u_jᵀ, no re-run.

    Shapes as in `tree_delta_rule`, with any leading dimensions (the cache commits all GDN layers at once);
    `grouped`: the state is [..., Hk, r, d_k, d_v], and so is the result. A fixed-shape round passes a path
    of fixed length whose tail repeats its last node, and `keep` [L] (True on the real path) so that the
    repeats add nothing."""
    index = torch.as_tensor(path, device=k.device)
    hk = k.shape[-3]
    r = result.u.shape[-3] // hk  # value heads per key head (Hv = r·Hk), whatever the state's layout
    c_path = result.c[..., index].unflatten(-2, (hk, r))  # [..., Hk, r, L]
    weights = (c_path[..., -1:] - c_path).exp()
    if keep is not None:
        weights = weights * keep.to(weights.dtype)
    weighted_keys = k[..., index, :].unsqueeze(-3) * weights[..., None]  # [.., Hk, r, L, d_k]
    deltas = result.u[..., index, :].unflatten(-3, (hk, r))  # [..., Hk, r, L, d_v]
    update = weighted_keys.transpose(-1, -2) @ deltas  # [..., Hk, r, d_k, d_v]
    state4 = state if grouped else state.unflatten(-3, (hk, r))
    new = torch.addcmul(update, state4, c_path[..., -1:, None].exp())
    return new if grouped else new.flatten(-4, -3)


def recurrent_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain recurrence along one sequence (shapes as in `tree_delta_rule`); returns (outputs, final state)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        u = beta[:, t, None] * (v[:, t] - (state * k[:, t, :, None]).sum(1))
        state = state + k[:, t, :, None] * u[:, None, :]
        outs.append((state * q[:, t, :, None]).sum(1))
    return torch.stack(outs, dim=1), state


def conv_windows(parents: torch.Tensor, kernel: int) -> torch.Tensor:
    """Index of each node's conv window in [conv state (kernel-1 inputs) ; tree inputs]: [n, kernel], on
    `parents`' device.

    Column kernel-1 is the node itself, column kernel-2 its parent, and so on; above the root the chain
    continues into the cached inputs (the last committed input is column kernel-2 of the root's window).
    Built with kernel-1 gathers, none per node.
    """
    history = kernel - 1
    device = parents.device
    # parent pointers over the extended sequence: cached input e has parent e-1; node i sits at history+i
    extended_parent = torch.cat(
        [torch.arange(-1, history - 1, device=device), torch.where(parents < 0, history - 1, parents + history)]
    )
    columns = [torch.arange(history, history + parents.shape[0], device=device)]
    for _ in range(history):
        columns.append(extended_parent[columns[-1]])
    return torch.stack(columns[::-1], dim=1)


def tree_conv(
    inputs: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU where each node sees its own ancestors: inputs [n, C], conv_state
    [kernel-1, C] (oldest first), weight [C, kernel]. Returns the outputs [n, C] and the extended inputs
    [kernel-1+n, C] that `commit_conv_state` gathers from."""
    extended = torch.cat([conv_state, inputs], dim=0)
    out = (extended[windows] * weight.t()).sum(1)  # [n, kernel, C] summed over the kernel
    if bias is not None:
        out = out + bias
    return F.silu(out), extended


def commit_conv_state(extended: torch.Tensor, windows: torch.Tensor, last: int) -> torch.Tensor:
    """The last kernel-1 inputs along the accepted path ending at node `last`."""
    return extended[..., windows[last, 1:], :]
