"""A decode round with every shape fixed and the host out of it: draft, tree, verify, walk and commit on the
device, for AR, DFlash and DDTree alike.

`loop.decode_from` is the reference round: it reads the target's choices to the host, walks the tree there
and copies the path back. Here each round is one call, `FixedRound.step`, that reads no device value and
whose tensors' shapes depend only on (method, budget, block size, cache capacity):

- the tree has `budget + 1` nodes (`block_size` for DFlash's chain, 1 for AR), built on the device
  (`device_tree`), padded when the candidates run out;
- the accepted path has `block_size` slots (1 for AR), its tail repeating its last node, and a count;
- attention reads the cache's whole capacity under a mask, and the committed lengths of the cache and the
  drafter's context are device scalars.

So `step` compiles once per (method, budget) and can be captured as a CUDA graph. The loop around it makes
the round's one device→host transfer: the emitted tokens and their count, packed in one tensor, which it
needs to check for stop tokens and the token limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from remote_worker.cache.hybrid_cache import HybridCache
from remote_worker.decoding.device_tree import DeviceTree, device_best_first_tree, device_chain
from remote_worker.decoding.emission import emit_round
from remote_worker.models.target import TargetModel


def compiled_entry(step: Callable[[], Any], mode: str | None, buffers: list[torch.Tensor]) -> Callable[[], Any]:
    """`step` through `torch.compile(fullgraph=True, dynamic=False)`: one graph, no break, compiled on the
    first call. `buffers`, the tensors `step` updates in place, are marked static, so a CUDA graph
    (`mode="reduce-overhead"`) updates them in place and is captured once; and each call first tells the
    graphs a new step begins: the previous call's outputs have been read (the loop copies what it keeps), so
    the graph may reuse their memory instead of recording another."""
    for tensor in buffers:
        torch._dynamo.mark_static_address(tensor)
    compiled = torch.compile(step, fullgraph=True, dynamic=False, mode=mode)
    if mode != "reduce-overhead":
        return compiled

    def run() -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled()

    return run


def device_walk(
    tree: DeviceTree, targets: torch.Tensor, mask: torch.Tensor, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted path on the device: (path [slots], count []), the path's tail past `count` repeating its
    last node. targets: the target's token at each node [n]; mask: the tree's ancestor-or-self mask [n, n].

    A node is accepted when every node on its root path (itself included, the root excepted) carries the
    token the target chose at that node's parent. Siblings carry distinct tokens, so the accepted nodes are
    one chain from the root, one per depth."""
    n = tree.size
    parent = tree.parents.clamp(min=0)
    is_root = torch.arange(n, device=targets.device) == 0
    matches = is_root | (tree.valid & (tree.tokens == targets[parent]))
    accepted = ~(mask & ~matches[None, :]).any(dim=-1)
    count = accepted.sum()
    last = torch.where(accepted, tree.depths, -1).argmax()
    # path[d] = the accepted node at depth d; the rest land in a spare slot that is then dropped
    place = torch.where(accepted, tree.depths, slots)
    path = torch.zeros(slots + 1, dtype=torch.long, device=targets.device)
    path = path.scatter(0, place, torch.arange(n, device=targets.device))[:slots]
    steps = torch.arange(slots, device=targets.device)
    return torch.where(steps < count, path, last), count


_LOW32 = 0xFFFFFFFF


def _times(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x·constant mod 2³² for x in [0, 2³²), in int64 without overflow: the high and low 16 bits apart."""
    high = ((x >> 16) * constant) & 0xFFFF
    return ((high << 16) + (x & 0xFFFF) * constant) & _LOW32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' `lowbias32`: xor-shifts and two odd multipliers; every output bit
    depends on every input bit) of int64 tensors holding values in [0, 2³²)."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """Uniform draws in (0, 1), float64 [rows, columns], a pure function of (seed, counter, row, column): a
    counter-based generator (as Philox is), so a round draws on the device with no generator state to
    carry, compiled or captured as a CUDA graph alike. seed, counter: int64 device scalars."""
    key = mix32((mix32(seed & _LOW32) ^ mix32(counter & _LOW32)) & _LOW32)
    index = torch.arange(rows * columns, device=seed.device).view(rows, columns)
    bits = mix32((mix32(index ^ key) + key) & _LOW32)  # two rounds: neighbouring indices decorrelate
    return (bits.double() + 0.5) / 2.0**32


def choose_on_device(
    logits: torch.Tensor, temperature: float, seed: torch.Tensor, counter: torch.Tensor
) -> torch.Tensor:
    """The target's token at each row, drawn on the device: argmax at temperature 0; else by Gumbel-max,
    argmax(logits / T + G) with G = -log(-log U) and U from `counter_uniform`, which is a sample from
    softmax(logits / T) (the Gumbel-max property), each row's independent of the others'."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    uniform = counter_uniform(seed, counter, logits.shape[0], logits.shape[1])
    return (logits.double() / temperature - torch.log(-torch.log(uniform))).argmax(dim=-1)


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token at each row, on the logits' device: argmax at temperature 0, else a sample from
    softmax(logits / T) drawn there (with a generator on that device; none draws from its default one)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@dataclass
class RoundOutput:
    """What one round leaves on the device: the packed result and what the AR margins are read from."""

    # [3 * slots + 2]: the emitted tokens (the first `count` are real), the path's nodes, their ranks among
    # their parents' candidates (`DeviceTree.ranks`), `count`, and 1 when the tree's scores were rounded
    # somewhere (`DeviceTree.exact` False: it may then differ from the host heap's at a tie)
    packed: torch.Tensor
    logits: torch.Tensor  # [n, vocab] the target's logits at every node
    path: torch.Tensor  # [slots]


class FixedRound:
    """The decode state of one (method, budget) in buffers allocated once — the target's cache and the
    drafter's context at a fixed `capacity`, the root token, the committed lengths, all on the device — and
    the round over them (`step`). `reset` loads a prompt's prefilled state into the same buffers, so a
    compiled round (`compile`) is compiled and captured once and serves every prompt."""

    one_size = True  # every round verifies `nodes` (what `round_times` can time whole as one size's round)

    def __init__(
        self,
        target: TargetModel,
        method: str,
        capacity: int,
        *,
        drafter: Any | None = None,
        budget: int = 0,
        temperature: float = 0.0,
    ) -> None:
        if method == "ddtree" and budget < 1:
            raise ValueError(f"a fixed-shape DDTree round needs a tree budget of at least 1, not {budget}")
        self.target, self.method, self.capacity = target, method, capacity
        self.drafter, self.budget, self.temperature = drafter, budget, temperature
        device = target.device
        self.drafting = method != "ar"
        self.depth = drafter.block_size - 1 if self.drafting else 0
        self.slots = self.depth + 1  # the longest accepted path: the root and one node per drafted position
        self.feature_layers = drafter.feature_layers if self.drafting else ()
        target.reserve_positions(capacity)
        self.cache = target.new_cache(capacity)
        self.cache.to_device_length()
        self.context = drafter.new_context(capacity) if self.drafting else None
        if self.context is not None:
            self.context.to_device_length()
        self.root = torch.zeros((), dtype=torch.long, device=device)
        # sampling (temperature > 0): the prompt's seed and the round's counter (`choose_on_device`)
        self.seed = torch.zeros((), dtype=torch.long, device=device)
        self.draws = torch.zeros((), dtype=torch.long, device=device)
        self.mask_embedding = None
        if self.drafting:
            with torch.no_grad():
                self.mask_embedding = target.embed(torch.tensor(drafter.mask_token_id, device=device))
        self.run = self.step  # `compile` replaces it with the compiled round

    @property
    def nodes(self) -> int:
        """The tree's size every round."""
        return self.budget + 1 if self.method == "ddtree" else self.slots

    def reset(self, cache: HybridCache, context: Any | None, root: int, generator: torch.Generator | None) -> None:
        """Start from a prefilled state (copied in place; the originals stay as they are). Whether the decode
        fits the capacity is `loop.decode_from`'s check, which knows how many tokens it will commit. At
        temperature > 0 the prompt's sampling seed is drawn from `generator` (seeded per prompt), here,
        once, so that the rounds draw on the device."""
        self.cache.load(cache)
        if self.context is not None:
            self.context.load(context)
        self.root.fill_(root)
        if self.temperature > 0:
            device = generator.device if generator is not None else "cpu"
            self.seed.fill_(int(torch.randint(0, 2**32, (1,), generator=generator, device=device)))
            self.draws.zero_()

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the round updates in place (static to a compiled graph)."""
        cache, context = self.cache, self.context
        tensors = [cache.kv, cache.conv, cache.recurrent, cache.device_length, self.root, self.seed, self.draws]
        if context is not None and hasattr(context, "buffer"):
            tensors += [context.buffer, context.device_length]
        return [t for t in tensors if t is not None]

    def compile(self, mode: str | None = None) -> None:
        """The round compiled (`compiled_entry`), its buffers static."""
        self.run = compiled_entry(self.step, mode, self.buffers())

    def draft(self, budget: int | None = None) -> DeviceTree:
        """This round's draft tree (DDTree: of `budget` nodes, the round's own by default)."""
        root = self.root
        if not self.drafting:
            one = torch.ones(1, dtype=torch.bool, device=root.device)
            zero = torch.zeros(1, dtype=torch.long, device=root.device)
            return DeviceTree(root.reshape(1).clone(), zero - 1, zero, one, zero.double(), zero, one[0])
        assert self.drafter is not None and self.mask_embedding is not None
        root_embedding = self.target.embed(root)
        logits = self.drafter.propose_fixed(self.context, root_embedding, self.mask_embedding, self.target.head)
        if self.method == "dflash":
            return device_chain(root, logits, self.depth)
        return device_best_first_tree(root, logits, budget or self.budget)

    @property
    def round_nodes(self) -> int:
        """The nodes the last round verified (a fixed round: always its tree's)."""
        return self.nodes

    def warm_every_size(self, reset: Callable[[int], None]) -> None:
        """Compile and capture every graph a decode may run, from the states `reset(attempt)` loads: a fixed
        round has one, which the warm-up's decodes ran (`online_round.OnlineRound` has one per size)."""

    def seen(self, path: list[int]) -> None:
        """What the last round accepted, read on the host (its path, root first): a fixed round needs nothing
        of it; `online_round.OnlineRound` learns from it."""

    @torch.no_grad()
    def step(self) -> RoundOutput:
        """One round, all on the device: no value is read back, no shape depends on one. (No autograd: the
        weights are parameters, and a compiled graph that records gradients is another, slower graph.)"""
        return self.verify_commit(self.draft())

    @torch.no_grad()
    def verify_commit(self, tree: DeviceTree) -> RoundOutput:
        """Verify `tree` in one target forward, choose the target's tokens, walk the accepted path and commit it
        to the cache and the drafter's context: the round after its draft."""
        output = self.target.verify_fixed(
            self.cache, tree.tokens, tree.parents, tree.depths, self.depth, self.feature_layers
        )
        assert output.logits is not None and self.cache.context is not None
        targets = choose_on_device(output.logits, self.temperature, self.seed, self.draws)
        self.draws.add_(1)
        path, count = device_walk(tree, targets, self.cache.context.mask, self.slots)
        self.cache.commit_fixed(path, count)
        if self.feature_layers:
            features = torch.cat([output.hidden[i][path] for i in self.feature_layers], dim=-1)
            self.drafter.extend_fixed(self.context, features, count)
        emitted = targets[path]  # each accepted node's child token is the target's choice there; then the bonus
        self.root.copy_(emitted[-1])  # the path's tail repeats its last node: this is the bonus token
        inexact = (~tree.exact).long()[None]
        packed = torch.cat([emitted, path, tree.ranks[path], count[None], inexact])
        return RoundOutput(packed, output.logits, path)


def run_rounds(
    state: FixedRound, result: Any, max_new_tokens: int, stop_tokens: frozenset[int], margins: bool
) -> list[tuple[torch.Tensor, int]]:
    """Rounds until the token limit or a stop token, into `result` (a `loop.DecodeResult`). With `margins`,
    returns per round the target's top-2 logits along the path (still on the device) and the path's length."""
    kept: list[tuple[torch.Tensor, int]] = []
    started = time.perf_counter()
    while len(result.tokens) < max_new_tokens:
        output = state.run()
        *columns, count, inexact = output.packed.tolist()  # the round's one device→host transfer
        slots = len(columns) // 3
        emitted, path, ranks = columns[:slots], columns[slots : 2 * slots], columns[2 * slots :]
        result.inexact_trees += inexact
        if margins:
            kept.append((output.logits[output.path].topk(2, dim=-1).values, count))
        if not result.tokens:
            result.first_token_seconds = time.perf_counter() - started
        state.seen(path[:count])
        nodes = state.round_nodes
        if emit_round(result, emitted[:count], path[1:count], ranks[1:count], nodes, stop_tokens, max_new_tokens):
            return kept
    return kept


def collect_margins(kept: list[tuple[torch.Tensor, int]], tokens: int) -> list[tuple[float, float]]:
    """The kept top-2 logits of the emitted tokens, read to the host once the clock has stopped."""
    rows = torch.cat([values[:count] for values, count in kept]).tolist() if kept else []
    return [(row[0], row[1]) for row in rows][:tokens]
