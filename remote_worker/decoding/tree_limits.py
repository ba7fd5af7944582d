"""How large a DDTree budget can be for a draft block, from the config alone.

No torch here: the orchestrator checks this before launch wherever it can read the model's config (an
inline config, a fixture shipped with the worker, a checkpoint on this machine), and the worker checks it
again once the model is loaded (a checkpoint on a remote host). What the device can hold is
`tree_memory`'s question, answered on the worker.
"""

from __future__ import annotations


def distinct_nodes(positions: int, vocab: int, cap: int = 1 << 62) -> int:
    """How many different nodes a draft block offers below its root, at most `cap`.

    A node is a choice of one of `vocab` tokens at each depth 1..d, d ≤ `positions` (the block's positions
    after the root, block_size - 1), so there are Σ vocab^d of them: the same token may sit at one depth
    under many parents. Only a block of one drafted position (decode.block_size=2) or a toy vocabulary
    bounds a budget in practice."""
    total, level = 0, 1
    for _ in range(positions):
        level *= vocab
        total += level
        if total >= cap:
            return cap
    return total


def beyond_draft(budget: int, block_size: int, vocab: int) -> str | None:
    """Why a tree of `budget` nodes cannot be drafted from a block of `block_size`, in one line; None when it
    can. Beyond `distinct_nodes` the tree would be padded (on the device) or smaller (on the host) while its
    run is named for the budget: a result that would not be what it says."""
    most = distinct_nodes(block_size - 1, vocab)
    if budget <= most:
        return None
    positions = block_size - 1
    return (
        f"decode.tree_budgets: budget {budget} is more nodes than a draft block of {block_size} can offer "
        f"({positions} drafted position{'s' * (positions != 1)} over a vocabulary of {vocab}: {most} distinct "
        f"nodes); lower the budget or raise decode.block_size"
    )
