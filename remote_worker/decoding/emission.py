"""What a round emits, and what it counts: the one rule both decode loops (eager and fixed-shape) follow.

A round commits its accepted path and the target's bonus token, but emits them only up to a stop token or
the token limit. The round's acceptance (and so tau, the budget curve and the acceptance profile) counts
the tokens emitted: drafted tokens accepted past an end token were never output, and counting them made a
one-token answer report tau = block size.
"""

from __future__ import annotations

from typing import Any


def emit_round(
    result: Any,
    emitted: list[int],
    nodes: list[int],
    ranks: list[int],
    tree_size: int,
    stop_tokens: frozenset[int],
    max_new_tokens: int,
) -> bool:
    """Record one round into `result` (a `loop.DecodeResult`): `emitted` is the accepted drafted tokens then
    the bonus, `nodes`/`ranks` the accepted path below the root. Returns True when the decode is done."""
    done = False
    count = 0
    for token in emitted:
        result.tokens.append(token)
        count += 1
        if token in stop_tokens or len(result.tokens) >= max_new_tokens:
            done = True
            break
    accepted = min(count - 1, len(nodes)) if count < len(emitted) else len(nodes)
    result.tree_sizes.append(tree_size)
    result.acceptance_lengths.append(accepted)
    result.accepted_nodes.append(nodes[:accepted])
    result.accepted_ranks.append(ranks[:accepted])
    return done
