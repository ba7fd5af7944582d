"""Where a speculative output leaves AR's, and whether rounding can explain it.

At temperature 0 DFlash and DDTree emit AR's tokens exactly when tree verification gives the same logits
as single-token decoding. In float32 on a CPU they do. In bfloat16 on a GPU the two reduce in different
orders, so their logits differ by a few units in the last place; where AR's best two tokens are that
close, the speculative output may take the other one, without any bug. So each divergence is judged by
AR's own margin at the first differing position: the top-1 logit minus the top-2 logit.

A margin within `NEAR_TIE_EPS` × ε(dtype) × max(1, |top-1 logit|) is a near tie (ε: the dtype's machine
epsilon, 2⁻⁷ for bfloat16, 2⁻²³ for float32): rounding of that size can flip it. Anything wider is
unexplained: a real bug until shown otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

NEAR_TIE_EPS = 4  # how many machine epsilons (relative to the top-1 logit) rounding may move a logit gap


def tie_tolerance(dtype: torch.dtype, top1: float) -> float:
    """The widest top-1/top-2 gap that rounding in `dtype` may flip, at a top-1 logit of `top1`."""
    return NEAR_TIE_EPS * torch.finfo(dtype).eps * max(1.0, abs(top1))


@dataclass(frozen=True)
class Divergence:
    position: int  # index in the generated tokens of the first difference
    ar_token: int | None  # None: AR had stopped there
    token: int | None  # None: the method had stopped there
    gap: float | None  # AR's top-1 minus top-2 logit at that position (None: not recorded)
    tolerance: float | None

    @property
    def near_tie(self) -> bool:
        return self.gap is not None and self.tolerance is not None and self.gap <= self.tolerance

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "kind": "near_tie" if self.near_tie else "unexplained"}


def first_divergence(
    ar_tokens: list[int], ar_margins: list[tuple[float, float]], tokens: list[int], dtype: torch.dtype
) -> Divergence | None:
    """None when `tokens` equals AR's; else where and how it first differs.

    ar_margins: AR's (top-1, top-2) logits at each of its tokens (`DecodeResult.margins`)."""
    if tokens == ar_tokens:
        return None
    position = next(
        (i for i, (a, b) in enumerate(zip(ar_tokens, tokens, strict=False)) if a != b), min(len(ar_tokens), len(tokens))
    )
    ar_token = ar_tokens[position] if position < len(ar_tokens) else None
    token = tokens[position] if position < len(tokens) else None
    if position >= len(ar_margins):
        return Divergence(position, ar_token, token, None, None)
    top1, top2 = ar_margins[position]
    return Divergence(position, ar_token, token, top1 - top2, tie_tolerance(dtype, top1))
