"""The draft's batched training forward computes what `propose` gives at each anchor, block by block."""

from __future__ import annotations

import pytest
import torch

from remote_worker.models.dflash import build_draft
from tests.test_draft_attention import config
from tests.tiny_models import tiny
from training.draft_forward import block_logits

# A draft shaped like the Qwen3.6 ones: causal, windowed sliding layers, then a full-attention layer.
SLIDING = config(["sliding_attention", "full_attention"], sliding_window=5, use_sliding_window=True)


@pytest.mark.parametrize("name", ["tiny_hybrid", "tiny_dense", "sliding_draft"])
def test_training_forward_matches_propose_at_every_anchor(name: str) -> None:
    if name == "sliding_draft":
        target, _ = tiny("tiny_hybrid", "float64")
        draft = build_draft(SLIDING, seed=1, dtype=torch.float64, device=torch.device("cpu"))
    else:
        target, draft = tiny(name, "float64")
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    features = target.prefill(cache, tokens, draft.feature_layers)
    anchors = torch.tensor([1, 7, 20, 39])
    with torch.no_grad():
        batched = torch.log_softmax(block_logits(draft, features, tokens, anchors, target.embed, target.head), -1)
    mask = target.embed(torch.tensor(draft.mask_token_id))
    for row, anchor in enumerate(anchors.tolist()):
        context = draft.new_context()
        draft.extend(context, features[:anchor])  # the features of the positions before the root only
        expected = torch.log_softmax(draft.propose(context, target.embed(tokens[anchor]), mask, target.head), -1)
        torch.testing.assert_close(batched[row], expected, rtol=1e-9, atol=1e-9)
