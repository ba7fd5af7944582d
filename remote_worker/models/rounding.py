"""How far two evaluations of the same logits may differ from rounding alone: a bound from a model of the
arithmetic, with no constant fitted to a CPU. The probe reports it beside the differences it measures, and
the tests hold the cache to it.

The model: a sum of n products in unit roundoff u errs by at most λ·√n·u relative to the sum of the terms'
magnitudes, with probability at least 1 - 2n·exp(-λ²(1-u)²/2) (Higham & Mary, "A new approach to
probabilistic rounding error analysis", 2019); λ = 8 makes a violation a 1e-10 event even for n = 6144. Two
evaluations in different orders (a tree against a fresh prefill, our layers against the model's own)
differ by at most the sum of both errors. We assume each of `depth` sequential stages (the layers, plus
the head) passes on the error that reaches it with a gain of about one, as a residual stream under RMSNorm
does, so the errors add: 2·λ·depth·√width·u, relative to max(1, the logits' scale), with `width` the
longest reduction of all (the GDN solve's node count included). That assumption is the heuristic part:
softmax, decays and the triangular solve can amplify, which the factor λ = 8 (against the typical λ of 1
to 2) is there to absorb. The measured errors sit two to three orders of magnitude below the bound.
"""

from __future__ import annotations

import math

import torch

from remote_worker.models.target import TargetModel

LAMBDA = 8.0


def rounding_bound(dtype: torch.dtype, depth: int, width: int, scale: float) -> float:
    u = torch.finfo(dtype).eps / 2
    return 2 * LAMBDA * depth * math.sqrt(width) * u * max(scale, 1.0)


def longest_reduction(target: TargetModel, tree_size: int = 1) -> int:
    """The longest sum any layer computes: over hidden, intermediate, attention's concatenated heads, GDN
    value heads, the keys attended to, or the nodes of a tree's solve."""
    config = target.model.config.get_text_config()
    widths = [config.hidden_size, config.intermediate_size, tree_size]
    for mixer in target.mixers:
        heads = getattr(mixer, "heads", None)
        if isinstance(heads, tuple):  # GDN: (Hk, Hv, d_k, d_v)
            widths.append(heads[1] * heads[3])
        elif heads is not None:
            widths.append(heads * mixer.head_dim)
    return max(widths)


def model_bound(target: TargetModel, scale: float, tree_size: int = 1) -> float:
    """Our float32/float64 layers against each other; a float64 model's own forward is held to float32's
    bound instead, since its norms, router and GDN kernel round through float32."""
    return rounding_bound(target.dtype, target.num_layers + 1, longest_reduction(target, tree_size), scale)


def own_forward_bound(target: TargetModel, scale: float, tokens: int) -> float:
    """Our layers against the model's own forward (which rounds through float32 even in float64)."""
    dtype = torch.float32 if target.dtype == torch.float64 else target.dtype
    return rounding_bound(dtype, target.num_layers + 1, longest_reduction(target, tokens), scale)
