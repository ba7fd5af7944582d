"""What a draft-tree node costs on this host: the four stages of a decode round, timed against tree size.

A DDTree round of budget b spends `draft + tree(b+1) + verify(b+1) + commit` (the stages of
`loop.decode_from`, tree sizes in nodes, root included), and commits tau(b) tokens on average; so
tokens/s(b) = tau(b) / round(b). This measures the round's terms, at a given context, on the target's
device, with their spread, so that tau(b) measured on any host predicts tokens/s(b) on this one
(`NodeCosts.round_ms`).

The state is the one a real decode is in: a prompt of `context` + 1 tokens prefilled with `loop.prefill`
(`context` committed tokens, the drafter fed their target features, the last token the root). For each
tree size n, `warmup` untimed rounds and then `repeats` timed rounds run from copies of that state (copied
untimed), each the reference round of `loop.decode_from` with its stages timed in place as the loop's
`_Timer` times them (the device synchronised around each: asynchronous work is charged to the stage that
queued it):

- draft: the root's embedding and `drafter.propose`, and after the commit `drafter.extend` with the
  committed path's target features. It does not depend on the tree: one figure, over every size's rounds.
- tree: `best_first_tree(root, logits, n - 1)`, the ranking of the candidates and the host heap. A tree of
  one node (AR's round, budget 0) builds nothing: ~0.
- verify: `target.verify` of that tree over the committed context with the drafter's feature layers, the
  choice of the target's token at every node (argmax: temperature 0) and its transfer to the host.
- commit: `cache.commit(path)` of the tree's rank-0 chain (from the root, the most likely child at each depth,
  cut at `accepted` drafted tokens, by default the block's block_size - 1: best-first pops that chain first,
  so it is the tree's deepest path). It is the longest path a round of that tree can accept, so the most
  work a commit of it does (K/V compaction and the GDN state advanced over the path): an upper-ish figure.

Why whole rounds, not each stage called alone in a loop: measured alone, a stage finds its weights and
inputs in the CPU's caches, where in a decode the other stages have just evicted them; on the trained tiny
pair the isolated figures were 10–40 % below the decode's own per-stage times; timed in rounds they come
within about 10 % of them (the verify of a mid-size tree the furthest). A `NodeCostSampler` gathers rounds
from several states (the decode experiment measures a slice after some of its prompts) into one figure.
What the round does outside the four stages (walking the tree for the accepted path, emitting its tokens, the
stop checks, the loop's own Python) is the fifth term, `other`: each timed round is also timed whole, and
`other` is the whole less its four stages. It weighs most on AR's one-node rounds, which are short.

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

from remote_worker.decoding.emission import emit_round
from remote_worker.decoding.fixed_round import choose
from remote_worker.decoding.loop import DecodeResult, Prefill, prefill, walk
from remote_worker.decoding.tree_build import DraftTree, best_first_tree
from remote_worker.decoding.tree_limits import distinct_nodes
from remote_worker.models.target import TargetModel
from remote_worker.wording import counted

# How `StageCost.low_ms` and `high_ms` are taken from the timed calls, in the record.
SPREAD = "min-max"
STAGES = ("draft", "tree", "verify", "commit", "other")  # what a timed round records (see the module)
WARMUP = 2  # untimed calls before a stage's timed ones, per tree size

Progress = Callable[[int, int, str], None]  # (done, total, what was just measured): node-rounds timed
Estimate = Callable[[float, str], None]  # (seconds the measurement should take, what the figure rests on)
PROGRESS_EVERY_S = 5.0  # the longest a measurement goes without a progress call


@dataclass(frozen=True)
class StageCost:
    """One stage at one tree size, over `repeats` timed calls after the warm-up: the median call, the fastest
    (`low_ms`) and slowest (`high_ms`) call, and their mean, in milliseconds (the mean is the median where a
    record predates it).

    A round's cost (`NodeCosts.round_ms`) adds the means: a decode's tokens/s is its tokens over its total
    time, a ratio of sums, and the sum of calls is their count times their mean. On a host whose other
    processes stall a call now and then (a 2-core machine, torch's threads on both) the decode's total pays
    every stall, where a median leaves them out."""

    median_ms: float
    low_ms: float
    high_ms: float
    mean_ms: float | None = None

    @property
    def average_ms(self) -> float:
        return self.median_ms if self.mean_ms is None else self.mean_ms

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> StageCost:
        if not samples_ms:
            raise ValueError("a stage cost needs at least one timed call")
        return cls(statistics.median(samples_ms), min(samples_ms), max(samples_ms), statistics.fmean(samples_ms))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StageCost:
        mean = record.get("mean_ms")
        return cls(float(record["median_ms"]), float(record["low_ms"]), float(record["high_ms"]),
                   float(mean) if mean is not None else None)  # fmt: skip


def _check_sizes(sizes: list[int]) -> list[int]:
    if not sizes or sizes[0] < 1 or any(b <= a for a, b in pairwise(sizes)):
        raise ValueError(f"sizes {sizes} must be increasing tree sizes of at least one node")
    return sizes


def interpolate(sizes: Sequence[int], costs: Sequence[StageCost], nodes: int) -> float:
    """The mean cost at `nodes` (within the sizes), linear between the two measured sizes around it."""
    right = bisect.bisect_left(sizes, nodes)
    if sizes[right] == nodes:
        return costs[right].average_ms
    left = right - 1
    share = (nodes - sizes[left]) / (sizes[right] - sizes[left])
    return costs[left].average_ms + share * (costs[right].average_ms - costs[left].average_ms)


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
    other: list[StageCost] = field(default_factory=list)  # per size: the round's wall time less its four stages
    block_size: int = 0  # the drafter's block
    accepted: int = 0  # drafted tokens accepted in the round whose extend the draft stage times
    commit_depths: list[int] = field(default_factory=list)  # per size: drafted tokens on the committed path
    warmup: int = WARMUP
    unmeasured: list[int] = field(default_factory=list)
    note: str = ""

    def __post_init__(self) -> None:
        _check_sizes(self.sizes)
        for name in ("tree", "verify", "commit", *(("other",) if self.other else ())):
            if len(getattr(self, name)) != len(self.sizes):
                raise ValueError(f"{name} has {len(getattr(self, name))} costs for {len(self.sizes)} sizes")
        if self.commit_depths and len(self.commit_depths) != len(self.sizes):
            raise ValueError(f"commit_depths has {len(self.commit_depths)} entries for {len(self.sizes)} sizes")

    @property
    def largest_budget(self) -> int:
        """The largest budget `round_ms` answers for: the largest tree measured, less its root."""
        return self.sizes[-1] - 1

    kind = "eager"  # what rounds the costs describe (`budget_choice` checks it against the run's)

    def round_ms(self, budget: int) -> float:
        """The mean round of DDTree budget `budget`: draft + tree(budget + 1) + verify(budget + 1) + commit
        + other, each term linear in nodes between the sizes measured around budget + 1, commit taken at the
        same size. Budget 0 is a round of one node with a draft: `ar_round_ms` is AR's."""
        nodes = budget + 1
        if nodes < self.sizes[0] or nodes > self.sizes[-1]:
            raise ValueError(
                f"budget {budget} is a tree of {nodes} nodes, outside the sizes measured "
                f"({self.sizes[0]}–{self.sizes[-1]} nodes, budgets {self.sizes[0] - 1}–{self.largest_budget})"
            )
        stages = (self.tree, self.verify, self.commit, *((self.other,) if self.other else ()))
        return self.draft.average_ms + sum(interpolate(self.sizes, costs, nodes) for costs in stages)

    def ar_round_ms(self) -> float:
        """AR's round: the one-node round without a draft (its tree is the root alone, built for nothing)."""
        return self.round_ms(0) - self.draft.average_ms

    def as_record(self) -> dict[str, Any]:
        """JSON-able (for node_costs.json and decode_summary.json); `from_record` reads it back."""
        record = asdict(self)
        record["spread"] = SPREAD  # what low_ms and high_ms are
        record["kind"] = self.kind
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
            other=costs("other") if record.get("other") else [],
            block_size=int(record.get("block_size", 0)),
            accepted=int(record.get("accepted", 0)),
            commit_depths=[int(d) for d in record.get("commit_depths", [])],
            warmup=int(record.get("warmup", WARMUP)),
            unmeasured=[int(s) for s in record.get("unmeasured", [])],
            note=str(record.get("note", "")),
        )


def metric_steps(costs: NodeCosts, prefix: str = "node_cost") -> list[tuple[int, dict[str, float]]]:
    """The costs as MLflow metrics by step: the draft at step 0, then per tree size (step = nodes) each
    stage's median, fastest and slowest call and the predicted round (MLflow draws a metric's history
    against its step: a curve per stage)."""

    def stage(name: str, cost: StageCost) -> dict[str, float]:
        return {f"{prefix}.{name}_ms": cost.median_ms, f"{prefix}.{name}_ms_low": cost.low_ms,
                f"{prefix}.{name}_ms_high": cost.high_ms}  # fmt: skip

    steps = [(0, stage("draft", costs.draft))]
    for index, size in enumerate(costs.sizes):
        metrics = {
            **stage("verify", costs.verify[index]),
            **stage("tree", costs.tree[index]),
            **(stage("other", costs.other[index]) if costs.other else {}),
            **stage("commit", costs.commit[index]),
            f"{prefix}.round_ms": costs.round_ms(size - 1),
        }
        steps.append((size, metrics))
    return steps


def node_cost_sizes(largest_budget: int, cap: int = 256) -> list[int]:
    """The tree sizes (nodes, root included) to measure for budgets up to `largest_budget`: 1, 2, 4, … up to
    the smallest power of two that holds `largest_budget` + 1 nodes, so `round_ms` answers every budget up to
    it by interpolation. Never past `cap` nodes: when the budget needs more, the sizes end at `cap` (a size
    of its own if not a power of two), and budgets past cap - 1 have no figure.

    A power of two less than half again below `cap` gives way to it (64 and 65 nodes, for a largest budget of
    64 with `cap` 65): two sizes a node or a few apart are the same work timed at different moments, and their
    difference, noise, became the slope of the budgets between them: a `make run` predicted 55.5 tokens/s at
    budget 63 and 33.2 at 64, measured 32.3."""
    if largest_budget < 0 or cap < 1:
        raise ValueError(f"largest_budget={largest_budget} must be >= 0 and cap={cap} >= 1")
    sizes = [1]
    while sizes[-1] < largest_budget + 1 and sizes[-1] < cap:
        sizes.append(min(2 * sizes[-1], cap))
    if len(sizes) > 2 and sizes[-1] == cap and 2 * sizes[-1] < 3 * sizes[-2]:
        del sizes[-2]
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


def _round(
    target: TargetModel,
    drafter: Any,
    cache: Any,
    context: Any,
    root: int,
    mask_embedding: torch.Tensor,
    nodes: int,
    path: list[int],
) -> dict[str, float]:
    """One round from copies of the measured state (copied untimed), each stage timed in place as
    `loop.decode_from` times it (the device synchronised around it), in milliseconds: the draft (propose, and
    the extend with the committed path's features), the tree of `nodes` nodes, its verify with the target's
    choice read to the host, and the commit of `path`; between them the loop's own work (the walk for the
    accepted path, the emitted tokens and their stop checks), and the round timed whole, whence `other`."""
    device = target.device
    cache, context = cache.clone(), context.clone()
    feature_layers = drafter.feature_layers
    timings: dict[str, float] = {}

    def timed(stage: str, call: Callable[[], Any]) -> Any:
        _sync(device)
        started = time.perf_counter()
        value = call()
        _sync(device)
        timings[stage] = timings.get(stage, 0.0) + 1000 * (time.perf_counter() - started)
        return value

    def verify() -> tuple[Any, torch.Tensor, list[int]]:
        output = target.verify(cache, draft.tree, feature_layers)
        chosen = choose(output.logits, 0.0, None)
        return output, chosen, chosen.tolist()

    _sync(device)
    started = time.perf_counter()
    root_on_device = torch.tensor(root, device=device)
    logits = timed("draft", lambda: drafter.propose(context, target.embed(root_on_device), mask_embedding, target.head))
    draft = timed("tree", lambda: best_first_tree(root, logits, nodes - 1))
    output, chosen, targets = timed("verify", verify)
    walked = walk(draft, targets)  # the loop's walk and emission, outside every stage (`other`)
    index = timed("commit", lambda: cache.commit(path))
    root_on_device = chosen[walked[-1]]  # the next round's root, as the loop takes it
    if feature_layers:
        features = [output.hidden[i] for i in feature_layers]
        timed("draft", lambda: drafter.extend(context, torch.cat([h[index] for h in features], dim=-1)))
    drafted = draft.tree.tokens.tolist()
    emitted = [drafted[i] for i in walked[1:]] + [targets[walked[-1]]]
    ranks = [draft.ranks[node] for node in walked[1:]]
    scratch = DecodeResult(tokens=[], acceptance_lengths=[])
    emit_round(scratch, emitted, walked[1:], ranks, draft.tree.size, frozenset(), len(emitted))
    _sync(device)
    timings["other"] = max(1000 * (time.perf_counter() - started) - sum(timings.values()), 0.0)
    return timings


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
    estimate: Estimate | None = None,
) -> NodeCosts:
    """Prefill `context` committed tokens (the prompt's tokens repeated or cut to `context` + 1, by
    `loop.prefill`) and measure every stage there (`measure_from`). `estimate(seconds, basis)` hears, before
    the first timed round, how long the whole measurement should take (`NodeCostSampler.estimate_s`)."""
    start = prefill(target, context_tokens(prompt, context), drafter)
    sampler = NodeCostSampler(target, drafter, sizes, accepted=accepted)
    if estimate is not None:
        estimate(*sampler.estimate_s(start, repeats, warmup))
    sampler.measure(start, repeats, warmup, progress)
    return sampler.costs()


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
    as it is. `progress(done, total, what)` after each tree size."""
    sampler = NodeCostSampler(target, drafter, sizes, accepted=accepted)
    sampler.measure(start, repeats, warmup, progress)
    return sampler.costs()


class NodeCostSampler:
    """Timed rounds at every tree size, gathered from one state or several (`measure`), then their figures
    (`costs`). The decode experiment measures a slice between prompts, at each prompt's own context, so the
    costs see the machine as the decodes around them did: on a shared CPU whose speed drifts by a third
    within a minute, costs taken all before the decode predicted its speeds 5–23 % too high in one run and
    15 % too low in another."""

    def __init__(self, target: TargetModel, drafter: Any, sizes: Sequence[int], *, accepted: int | None = None):
        self.target, self.drafter, self.sizes = target, drafter, _check_sizes(list(sizes))
        positions = drafter.block_size - 1
        self.accepted = positions if accepted is None else accepted
        if not 0 <= self.accepted <= positions:
            raise ValueError(
                f"accepted={self.accepted} must be between 0 and the block's {positions} drafted positions"
            )
        self.samples = {n: {stage: [] for stage in STAGES} for n in self.sizes}
        self.depths: dict[int, int] = {}
        self.contexts: list[int] = []
        self.warmup = WARMUP
        self.unmeasured: list[int] = []
        self.note = ""

    def estimate_s(self, start: Prefill, repeats: int, warmup: int = WARMUP) -> tuple[float, str]:
        """How long `measure` should take from `start`, in seconds, and its basis: one round timed at the
        smallest and at the largest tree size, a round's cost taken as linear in nodes between them (a
        round's work is; its first call runs a little slow, so this errs long)."""
        base_cache, base_context = start.fork()
        room = base_cache.length + max(self.sizes[-1], self.drafter.block_size) + 1
        base_cache.reserve(room)
        base_context.reserve(room)
        self.target.reserve_positions(room)
        device = self.target.device
        mask_embedding = self.target.embed(torch.tensor(self.drafter.mask_token_id, device=device))
        logits = self.drafter.propose(
            base_context.clone(), self.target.embed(torch.tensor(start.root, device=device)), mask_embedding,
            self.target.head,
        )  # fmt: skip
        seconds = {}
        for nodes in sorted({self.sizes[0], self.sizes[-1]}):
            built = best_first_tree(start.root, logits, nodes - 1)
            nodes = built.tree.size
            path = rank0_chain(built)[: self.accepted + 1]
            started = time.perf_counter()
            _round(self.target, self.drafter, base_cache, base_context, start.root, mask_embedding, nodes, path)
            seconds[nodes] = time.perf_counter() - started
        (small, first), (large, last) = min(seconds.items()), max(seconds.items())
        slope = (last - first) / (large - small) if large > small else 0.0
        total = sum((warmup + repeats) * max(first + slope * (n - small), 0.0) for n in self.sizes)
        return total, f"one round took {first:.2g} s at {counted(small, 'node')}, {last:.2g} s at {large}"

    def measure(self, start: Prefill, repeats: int, warmup: int = WARMUP, progress: Progress | None = None) -> None:
        """`warmup` untimed and `repeats` timed rounds per tree size from the state of `start` (which stays as
        it is). A size whose tree this state's draft cannot fill is not measured here (`unmeasured`, `note`
        say why when no state could)."""
        if repeats < 1 or warmup < 0:
            raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
        if start.draft_context is None:
            raise ValueError("the prefill did not feed a drafter: prefill with the drafter to measure its draft")
        target, drafter = self.target, self.drafter
        positions = drafter.block_size - 1
        device, vocab = target.device, target.head.out_features
        base_cache, base_context = start.fork()
        context = base_cache.length
        room = context + max(self.sizes[-1], drafter.block_size) + 1
        base_cache.reserve(room)  # nothing grows inside a timed call (each round's clones keep this capacity)
        base_context.reserve(room)
        target.reserve_positions(room)
        root = torch.tensor(start.root, device=device)
        mask_embedding = target.embed(torch.tensor(drafter.mask_token_id, device=device))
        logits = drafter.propose(base_context.clone(), target.embed(root), mask_embedding, target.head)
        self.contexts.append(context)
        self.warmup = warmup
        # Progress counts node-rounds, so that its bar and ETA follow the work (the largest tree is most of
        # it), and is sent between rounds at least every PROGRESS_EVERY_S: one size of thousands of nodes
        # takes minutes on a CPU, which was silence before.
        rounds = warmup + repeats
        total, done, said = sum(self.sizes) * rounds, 0, time.monotonic()
        for nodes in self.sizes:
            built = best_first_tree(start.root, logits, nodes - 1)
            if built.tree.size < nodes:
                offered = distinct_nodes(positions, vocab)
                self.note = (
                    f"a tree of {nodes} nodes needs {nodes - 1} below its root; a draft block of "
                    f"{drafter.block_size} offers {min(offered, built.tree.size - 1)} ({positions} drafted "
                    f"position{'s' * (positions != 1)} over a vocabulary of {vocab})"
                )
                if progress is not None:
                    progress(total, total, f"sizes from {counted(nodes, 'node')} not measured: {self.note}")
                break
            path = rank0_chain(built)[: self.accepted + 1]
            self.depths[nodes] = len(path) - 1
            for attempt in range(rounds):
                timings = _round(target, drafter, base_cache, base_context, start.root, mask_embedding, nodes, path)
                done += nodes
                if attempt >= warmup:
                    for stage, ms in timings.items():
                        self.samples[nodes][stage].append(ms)
                if progress is not None and attempt + 1 < rounds and time.monotonic() - said >= PROGRESS_EVERY_S:
                    progress(done, total, f"{counted(nodes, 'node')}: round {attempt + 1}/{rounds}")
                    said = time.monotonic()
            if progress is not None:
                verify = statistics.median(self.samples[nodes]["verify"])
                progress(done, total, f"{counted(nodes, 'node')}: verify {verify:.3g} ms")
                said = time.monotonic()

    def costs(self) -> NodeCosts:
        """The figures over every timed round so far, at their mean context."""
        measured = [n for n in self.sizes if self.samples[n]["verify"]]
        if not measured:
            raise ValueError(f"no tree size could be measured: {self.note}")
        # a size is only as measured as the smallest ones: stop at the first gap
        measured = [n for i, n in enumerate(measured) if n == self.sizes[i]]
        unmeasured = [n for n in self.sizes if n not in measured]

        def stage(name: str) -> list[StageCost]:
            return [StageCost.of(self.samples[n][name]) for n in measured]

        return NodeCosts(
            sizes=measured,
            context=round(statistics.fmean(self.contexts)),
            repeats=min(len(self.samples[n]["verify"]) for n in measured),
            device=str(self.target.device),
            draft=StageCost.of([ms for n in measured for ms in self.samples[n]["draft"]]),
            tree=stage("tree"),
            verify=stage("verify"),
            commit=stage("commit"),
            other=stage("other"),
            block_size=self.drafter.block_size,
            accepted=self.accepted,
            commit_depths=[self.depths[n] for n in measured],
            warmup=self.warmup,
            unmeasured=unmeasured,
            note=self.note if unmeasured else "",
        )
