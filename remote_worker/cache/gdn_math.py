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
    out: torch.Tensor  # [H, n, d_v] per-node outputs
    u: torch.Tensor  # [H, n, d_v] the per-node deltas, reused by commit
    c: torch.Tensor  # [H, n] log-decay summed along each node's root path


def _masked_decay(c: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """D[h, i, j] = exp(c_i - c_j) where mask[i, j], else 0 (masked before exp, so nothing overflows)."""
    diff = c[:, :, None] - c[:, None, :]
    return torch.where(mask, diff, torch.full_like(diff, float("-inf"))).exp()


def tree_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    mask: torch.Tensor,
) -> TreeDeltaResult:
    """All nodes of a tree at once. q, k: [H, n, d_k] (already normalised, q scaled); v: [H, n, d_v];
    g, beta: [H, n]; state: [H, d_k, d_v]; mask: [n, n] ancestor-or-self (nodes in topological order)."""
    c = g @ mask.to(g.dtype).t()  # c_i = Σ_{j ancestor-or-self of i} g_j
    decay = _masked_decay(c, mask)
    strict = mask & ~torch.eye(mask.shape[0], dtype=torch.bool, device=mask.device)
    lower = (beta[:, :, None] * (k @ k.transpose(1, 2))) * decay * strict
    system = lower + torch.eye(mask.shape[0], dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * (v - (c.exp()[:, :, None] * k) @ state)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = c.exp()[:, :, None] * (q @ state) + ((q @ k.transpose(1, 2)) * decay) @ u
    return TreeDeltaResult(out=out, u=u, c=c)


def commit_state(
    state: torch.Tensor, k: torch.Tensor, result: TreeDeltaResult, path: list[int] | torch.Tensor
) -> torch.Tensor:
    """The state after the accepted path (root first): exp(c_m) S + Σ_j exp(c_m - c_j) k_j u_jᵀ, no re-run."""
    index = torch.as_tensor(path, device=k.device)
    c_path = result.c[:, index]  # [H, len(path)]
    weighted_keys = k[:, index] * (c_path[:, -1:] - c_path).exp()[:, :, None]
    decayed = state * c_path[:, -1].exp()[:, None, None]
    return torch.baddbmm(decayed, weighted_keys.transpose(1, 2), result.u[:, index])


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
    """Index of each node's conv window in [conv state (kernel-1 inputs) ; tree inputs]: [n, kernel].

    Column kernel-1 is the node itself, column kernel-2 its parent, and so on; above the root the chain
    continues into the cached inputs (the last committed input is column kernel-2 of the root's window).
    """
    history = kernel - 1
    n = parents.shape[0]
    # parent pointers over the extended sequence: cached input e has parent e-1; node i sits at history+i
    extended_parent = torch.cat(
        [torch.arange(-1, history - 1), torch.where(parents < 0, history - 1, parents + history)]
    )
    windows = torch.empty(n, kernel, dtype=torch.long)
    windows[:, -1] = torch.arange(history, history + n)
    for col in range(kernel - 2, -1, -1):
        windows[:, col] = extended_parent[windows[:, col + 1]]
    return windows


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
    gathered = extended[windows.to(inputs.device)]  # [n, kernel, C]
    out = (gathered * weight.t()[None]).sum(1)
    if bias is not None:
        out = out + bias
    return F.silu(out), extended


def commit_conv_state(extended: torch.Tensor, windows: torch.Tensor, last: int) -> torch.Tensor:
    """The last kernel-1 inputs along the accepted path ending at node `last`."""
    return extended[windows[last, 1:].to(extended.device)]
