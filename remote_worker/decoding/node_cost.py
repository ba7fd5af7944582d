"""What a draft-tree node costs on this host: the four stages of a decode round, timed against tree size.

A DDTree round of budget b spends `draft + tree(b+1) + verify(b+1) + commit` (the stages of
`loop.decode_from`, tree sizes in nodes, root included), and commits tau(b) tokens on average; so
tokens/s(b) = tau(b) / round(b). This measures the round's terms, at a given context, on the target's
device, with their spread, so that tau(b) measured on any host predicts tokens/s(b) on this one
(`NodeCosts.round_ms`).

The state is the one a real decode is in: a prompt of `context` + 1 tokens prefilled with `loop.prefill`
(`context` committed tokens, the drafter fed their target features, the last token the root), and one real
proposal of the drafter from it, whose logits build every tree. Each stage runs the very calls of
`decode_from`'s reference round, each call timed alone, the device synchronised before and after it (the
`_Timer`'s rule: asynchronous work is charged to the call that queued it), after `warmup` untimed calls:

- draft: the root's embedding and `drafter.propose`, then `drafter.extend` with the target features of the
  committed path (gathered from a verify's hidden states and concatenated, as the loop does). The draft does
  not depend on the tree, so it is one figure. The extend takes `accepted` + 1 rows (default: the block's
  block_size - 1 accepted, the most one round can accept; its cost barely depends on the rows). Between
  calls the drafter's context is rolled back to `context` tokens (untimed), so every call drafts there.
- tree_build: `best_first_tree(root, logits, n - 1)` for a tree of n nodes, the top-k of the logits and the
  host heap. A tree of one node (AR's round, budget 0) builds nothing: ~0.
- verify: `target.verify` of that tree over the committed context with the drafter's feature layers, the
  choice of the target's token at every node (argmax: temperature 0) and its transfer to the host. A verify
  leaves the committed state as it is, so the same cache serves every call.
- commit: `cache.commit(path)` of the tree's rank-0 chain (from the root, the most likely child at each depth,
  as deep as the tree goes: best-first pops that chain first, so it is the tree's deepest path, at most
  block_size - 1 drafted tokens). It is the longest path a round of that tree can accept, so the most work a
  commit of that tree does (K/V compaction and the GDN state advanced over the path): an upper-ish figure,
  and the one a well-predicted round approaches. A commit changes the committed state, so each call commits
  into a fresh clone of the measured cache, verified beforehand (clone and verify untimed).

What the round does outside the four stages (walking the tree for the accepted path, emitting tokens, the
loop's own Python) is in no stage and so not in `round_ms`. The stages are timed one after the other,
not interleaved within a round: a figure is a stage's cost with its inputs ready, as the loop's timer
charges it.

Nothing of the caller's prefill is changed: the measurement runs on a fork of it (`Prefill.fork`). A tree
size the draft cannot fill (a toy vocabulary, a block of few positions: `tree_limits.distinct_nodes`) is not
measured; it and every larger size are listed in `NodeCosts.unmeasured`, with the reason in `note`.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import torch

from remote_worker.decoding.fixed_round import choose
from remote_worker.decoding.loop import Prefill, prefill
from remote_worker.decoding.tree_build import DraftTree, best_first_tree, chain_tree
from remote_worker.decoding.tree_limits import distinct_nodes
from remote_worker.models.target import TargetModel

# How `StageCost.low_ms` and `high_ms` are taken from the timed calls, in the record.
SPREAD = "min-max"
WARMUP = 2  # untimed calls before a stage's timed ones, per tree size

Progress = Callable[[int, int, str], None]  # (done, total, what was just measured)


@dataclass(frozen=True)
class StageCost:
    """One stage at one tree size, over `repeats` timed calls after the warm-up: the median call, and the
    fastest (`low_ms`) and slowest (`high_ms`) call, in milliseconds."""

    median_ms: float
    low_ms: float
    high_ms: float

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> StageCost:
        if not samples_ms:
            raise ValueError("a stage cost needs at least one timed call")
        return cls(statistics.median(samples_ms), min(samples_ms), max(samples_ms))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StageCost:
        return cls(float(record["median_ms"]), float(record["low_ms"]), float(record["high_ms"]))


def _check_sizes(sizes: list[int]) -> list[int]:
    if not sizes or sizes[0] < 1 or any(b <= a for a, b in pairwise(sizes)):
        raise ValueError(f"sizes {sizes} must be increasing tree sizes of at least one node")
    return sizes


def _interpolate(sizes: Sequence[int], costs: Sequence[StageCost], nodes: int) -> float:
    """The median cost at `nodes` (within the sizes), linear between the two measured sizes around it."""
    right = bisect.bisect_left(sizes, nodes)
    if sizes[right] == nodes:
        return costs[right].median_ms
    left = right - 1
    share = (nodes - sizes[left]) / (sizes[right] - sizes[left])
    return costs[left].median_ms + share * (costs[right].median_ms - costs[left].median_ms)


@dataclass(frozen=True)
class NodeCosts:
    """The stages of a decode round against tree size, on one device at one context (see the module).

    `sizes` are the tree sizes measured, in nodes with the root, increasing; `tree`, `verify` and `commit`
    hold one `StageCost` per size, `draft` one for all. `unmeasured`: requested sizes the draft could not fill,
    and `note` why (empty when every size was measured)."""

    sizes: list[int]
    context: int  # committed tokens in the cache when measured
    repeats: int  # timed calls per stage and size (after `warmup` untimed ones)
    device: str
    draft: StageCost  # one propose + one extend of `accepted` + 1 rows; independent of the tree
    tree: list[StageCost]  # per size: best_first_tree with budget size - 1 (size 1: no tree, ~0)
    verify: list[StageCost]  # per size: target.verify of a tree of that many nodes, the choice, to the host
    commit: list[StageCost]  # per size: commit of the tree's rank-0 chain (`commit_depths` drafted tokens)
    block_size: int = 0  # the drafter's block
    accepted: int = 0  # drafted tokens accepted in the round whose extend the draft stage times
    commit_depths: list[int] = field(default_factory=list)  # per size: drafted tokens on the committed path
    warmup: int = WARMUP
    unmeasured: list[int] = field(default_factory=list)
    note: str = ""

    def __post_init__(self) -> None:
        _check_sizes(self.sizes)
        for name in ("tree", "verify", "commit"):
            if len(getattr(self, name)) != len(self.sizes):
                raise ValueError(f"{name} has {len(getattr(self, name))} costs for {len(self.sizes)} sizes")
        if self.commit_depths and len(self.commit_depths) != len(self.sizes):
            raise ValueError(f"commit_depths has {len(self.commit_depths)} entries for {len(self.sizes)} sizes")

    @property
    def largest_budget(self) -> int:
        """The largest budget `round_ms` answers for: the largest tree measured, less its root."""
        return self.sizes[-1] - 1

    def round_ms(self, budget: int) -> float:
        """The median round of DDTree budget `budget`: draft + tree(budget + 1) + verify(budget + 1) + commit,
        each term linear in nodes between the sizes measured around budget + 1, commit taken at the same
        size. Budget 0 is AR's round of one node (with the draft's cost: call `round_ms(0) - draft` for AR)."""
        nodes = budget + 1
        if nodes < self.sizes[0] or nodes > self.sizes[-1]:
            raise ValueError(
                f"budget {budget} is a tree of {nodes} nodes, outside the sizes measured "
                f"({self.sizes[0]}–{self.sizes[-1]} nodes, budgets {self.sizes[0] - 1}–{self.largest_budget})"
            )
        stages = (self.tree, self.verify, self.commit)
        return self.draft.median_ms + sum(_interpolate(self.sizes, costs, nodes) for costs in stages)

    def as_record(self) -> dict[str, Any]:
        """JSON-able (for node_costs.json and decode_summary.json); `from_record` reads it back."""
        record = asdict(self)
        record["spread"] = SPREAD  # what low_ms and high_ms are
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> NodeCosts:
        def costs(name: str) -> list[StageCost]:
            return [StageCost.from_record(r) for r in record[name]]

        return cls(
            sizes=[int(s) for s in record["sizes"]],
            context=int(record["context"]),
            repeats=int(record["repeats"]),
            device=str(record["device"]),
            draft=StageCost.from_record(record["draft"]),
            tree=costs("tree"),
            verify=costs("verify"),
            commit=costs("commit"),
            block_size=int(record.get("block_size", 0)),
            accepted=int(record.get("accepted", 0)),
            commit_depths=[int(d) for d in record.get("commit_depths", [])],
            warmup=int(record.get("warmup", WARMUP)),
            unmeasured=[int(s) for s in record.get("unmeasured", [])],
            note=str(record.get("note", "")),
        )


def node_cost_sizes(largest_budget: int, cap: int = 256) -> list[int]:
    """The tree sizes (nodes, root included) to measure for budgets up to `largest_budget`: 1, 2, 4, … up to
    the smallest power of two that holds `largest_budget` + 1 nodes, so `round_ms` answers every budget up to
    it by interpolation. Never past `cap` nodes: when the budget needs more, the sizes end at `cap` (a size
    of its own if not a power of two), and budgets past cap - 1 have no figure."""
    if largest_budget < 0 or cap < 1:
        raise ValueError(f"largest_budget={largest_budget} must be >= 0 and cap={cap} >= 1")
    sizes = [1]
    while sizes[-1] < largest_budget + 1 and sizes[-1] < cap:
        sizes.append(min(2 * sizes[-1], cap))
    return sizes


def context_tokens(prompt: torch.Tensor, context: int) -> torch.Tensor:
    """`context` + 1 tokens: the prompt's, repeated as often as needed and cut there (the last is the root)."""
    if prompt.dim() != 1 or prompt.shape[0] == 0:
        raise ValueError("the prompt must be a non-empty 1-D tensor of token ids")
    if context < 1:
        raise ValueError(f"context={context} must be at least one committed token")
    return prompt.repeat(-(-(context + 1) // prompt.shape[0]))[: context + 1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(
    device: torch.device,
    call: Callable[[], object],
    repeats: int,
    warmup: int,
    prepare: Callable[[], object] | None = None,
) -> StageCost:
    """`warmup` untimed calls, then `repeats` timed ones; `prepare` runs before each, untimed."""
    samples = []
    for attempt in range(warmup + repeats):
        if prepare is not None:
            prepare()
        _sync(device)
        started = time.perf_counter()
        call()
        _sync(device)
        if attempt >= warmup:
            samples.append(1000 * (time.perf_counter() - started))
    return StageCost.of(samples)


def rank0_chain(draft: DraftTree) -> list[int]:
    """The path from the root through each node's most likely child (its rank-0 candidate): the tree's
    deepest path (see the module), the one `commit` is timed on."""
    path = [0]
    while draft.children[path[-1]]:
        path.append(max(draft.children[path[-1]].values(), key=lambda node: draft.scores[node]))
    return path


def measure_node_costs(
    target: TargetModel,
    drafter: Any,
    prompt: torch.Tensor,
    context: int,
    sizes: Sequence[int],
    repeats: int,
    progress: Progress | None = None,
    *,
    warmup: int = WARMUP,
    accepted: int | None = None,
) -> NodeCosts:
    """Prefill `context` committed tokens (the prompt's tokens repeated or cut to `context` + 1, by
    `loop.prefill`) and measure every stage there (`measure_from`)."""
    start = prefill(target, context_tokens(prompt, context), drafter)
    return measure_from(target, drafter, start, sizes, repeats, progress, warmup=warmup, accepted=accepted)


def measure_from(
    target: TargetModel,
    drafter: Any,
    start: Prefill,
    sizes: Sequence[int],
    repeats: int,
    progress: Progress | None = None,
    *,
    warmup: int = WARMUP,
    accepted: int | None = None,
) -> NodeCosts:
    """The stage costs (see the module) at the state of `start` (a prefill that fed the drafter), which stays
    as it is. `progress(done, total, what)` after the draft and after each tree size."""
    sizes = _check_sizes(list(sizes))
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    if start.draft_context is None:
        raise ValueError("the prefill did not feed a drafter: prefill with the drafter to measure its draft")
    positions = drafter.block_size - 1
    accepted = positions if accepted is None else accepted
    if not 0 <= accepted <= positions:
        raise ValueError(f"accepted={accepted} must be between 0 and the block's {positions} drafted positions")
    device, vocab = target.device, target.head.out_features
    total = len(sizes) + 1
    cache, draft_context = start.fork()
    context = cache.length
    room = context + max(sizes[-1], drafter.block_size) + 1
    cache.reserve(room)  # nothing grows inside a timed call (the clones a commit takes keep this capacity)
    draft_context.reserve(room)
    target.reserve_positions(room)
    feature_layers = drafter.feature_layers
    root = torch.tensor(start.root, device=device)
    mask_embedding = target.embed(torch.tensor(drafter.mask_token_id, device=device))
    logits = drafter.propose(draft_context, target.embed(root), mask_embedding, target.head)

    # The committed path's features, as a verify of that path leaves them for the extend.
    chain = chain_tree(start.root, logits, accepted)
    hidden = target.verify(cache, chain.tree, feature_layers).hidden
    index = torch.arange(chain.tree.size, device=device)

    def draft_call() -> None:
        drafter.propose(draft_context, target.embed(root), mask_embedding, target.head)
        if feature_layers:
            drafter.extend(draft_context, torch.cat([hidden[i][index] for i in feature_layers], dim=-1))

    def roll_back() -> None:
        draft_context.length = context

    draft = _time(device, draft_call, repeats, warmup, roll_back)
    roll_back()
    if progress is not None:
        progress(1, total, f"draft {draft.median_ms:.3g} ms")

    tree: list[StageCost] = []
    verify: list[StageCost] = []
    commit: list[StageCost] = []
    depths: list[int] = []
    measured: list[int] = []
    unmeasured: list[int] = []
    note = ""
    for position, nodes in enumerate(sizes, start=2):
        built = best_first_tree(start.root, logits, nodes - 1)
        if built.tree.size < nodes:
            unmeasured = sizes[position - 2 :]
            offered = distinct_nodes(positions, vocab)
            note = (
                f"a tree of {nodes} nodes needs {nodes - 1} below its root; a draft block of {drafter.block_size} "
                f"offers {min(offered, built.tree.size - 1)} ({positions} drafted position{'s' * (positions != 1)} "
                f"over a vocabulary of {vocab})"
            )
            break
        path = rank0_chain(built)
        tree.append(_time(device, lambda n=nodes: best_first_tree(start.root, logits, n - 1), repeats, warmup))

        def verify_call(draft_tree: DraftTree = built) -> None:
            output = target.verify(cache, draft_tree.tree, feature_layers)
            choose(output.logits, 0.0, None).tolist()

        verify.append(_time(device, verify_call, repeats, warmup))
        fresh: list[Any] = []

        def verified_clone(draft_tree: DraftTree = built, fresh: list[Any] = fresh) -> None:
            fresh[:] = [cache.clone()]
            target.verify(fresh[0], draft_tree.tree, feature_layers)

        commit.append(_time(device, lambda p=path, fresh=fresh: fresh[0].commit(p), repeats, warmup, verified_clone))
        fresh.clear()
        depths.append(len(path) - 1)
        measured.append(nodes)
        if progress is not None:
            progress(position, total, f"{nodes} nodes: verify {verify[-1].median_ms:.3g} ms")
    if not measured:
        raise ValueError(f"no tree size could be measured: {note}")
    if unmeasured and progress is not None:
        progress(total, total, f"sizes from {unmeasured[0]} nodes not measured: {note}")
    return NodeCosts(
        sizes=measured,
        context=context,
        repeats=repeats,
        device=str(device),
        draft=draft,
        tree=tree,
        verify=verify,
        commit=commit,
        block_size=drafter.block_size,
        accepted=accepted,
        commit_depths=depths,
        warmup=warmup,
        unmeasured=unmeasured,
        note=note,
    )
