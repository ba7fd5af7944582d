"""One full period of Qwen3.6-27B's layer pattern at its real widths (hidden 5120, GDN 16×128 keys and
48×128 values, attention 24/4 heads of 256, MLP 17408; a 1024-token vocabulary), in float32 and bfloat16.

Tree verification and commit through the hybrid cache are held against the model's own forward: in float32
within the rounding bound (tests/rounding.py); in bfloat16 within the model's own bfloat16 error, i.e. our
bfloat16 logits may not be further from the float32 truth than twice as far as the model's own bfloat16
forward is (two evaluations with errors of that size). About 7 GB and 2 minutes on 2 cores: not part of
`make test`; `make test-realwidth` runs it (and .ci/run does). Prints the figures.
"""

from __future__ import annotations

import gc

import pytest
import torch

from remote_worker.cache.tree import Tree
from remote_worker.models.loading import cast_like_a_checkpoint, model_class
from remote_worker.models.target import TargetModel
from remote_worker.models.twins import one_period
from tests.rounding import own_forward_bound

pytestmark = pytest.mark.realwidth

PREFIX, TREE_PARENTS, PATH_END = 16, [-1, 0, 1, 1, 0, 4, 2], 6


def own_logits(model: torch.nn.Module, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model's own forward, the last position's logits of each sequence (float64 copies)."""
    with torch.no_grad():
        return [model(s[None]).logits[0, -1].double() for s in sequences]


def through_the_cache(target: TargetModel, prefix: torch.Tensor, tree: Tree, extra: torch.Tensor) -> list[torch.Tensor]:
    """Every tree node's logits from one verify, then the next token's after committing a branch."""
    cache = target.new_cache()
    target.prefill(cache, prefix, chunk=5)
    verified = target.verify(cache, tree).logits.double()
    cache.commit(tree.path_to(PATH_END))
    continued = target.verify(cache, Tree.chain(extra)).logits[-1].double()
    return [*verified, continued]


def test_one_period_of_qwen3_6_27b_at_real_widths() -> None:
    twin = one_period("Qwen3.6-27B")
    cls = model_class(twin.arch)
    torch.manual_seed(0)
    model = cls(cls.config_class(**twin.config)).eval()
    vocab = twin.config["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (PREFIX,), generator=generator)
    tree = Tree.from_parents(torch.randint(0, vocab, (len(TREE_PARENTS),), generator=generator), TREE_PARENTS)
    extra = torch.randint(0, vocab, (1,), generator=generator)
    sequences = [torch.cat([prefix, tree.tokens[tree.path_to(node)]]) for node in range(tree.size)]
    sequences.append(torch.cat([prefix, tree.tokens[tree.path_to(PATH_END)], extra]))

    truth = own_logits(model, sequences)  # float32, the model's own
    target = TargetModel(model)
    ours32 = through_the_cache(target, prefix, tree, extra)
    scale = max(t.abs().max().item() for t in truth)
    error32 = max((a - b).abs().max().item() for a, b in zip(ours32, truth, strict=True))
    bound32 = own_forward_bound(target, scale, sequences[-1].shape[0])
    del target
    gc.collect()

    cast_like_a_checkpoint(model, torch.bfloat16)
    own16 = own_logits(model, sequences)
    ours16 = through_the_cache(TargetModel(model), prefix, tree, extra)
    own_error16 = max((a - b).abs().max().item() for a, b in zip(own16, truth, strict=True))
    error16 = max((a - b).abs().max().item() for a, b in zip(ours16, truth, strict=True))
    apart16 = max((a - b).abs().max().item() for a, b in zip(ours16, own16, strict=True))
    print(
        f"\nreal-width Qwen3.6-27B period (|logit| up to {scale:.3g}): max |Δlogit| float32 ours vs own "
        f"{error32:.3g} (bound {bound32:.3g}); bfloat16 ours vs float32 {error16:.3g}, own bfloat16 vs float32 "
        f"{own_error16:.3g}, ours vs own bfloat16 {apart16:.3g}"
    )
    assert error32 <= bound32
    assert error16 <= 2 * own_error16, (error16, own_error16)
