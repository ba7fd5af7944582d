"""AR, DFlash and DDTree decoding: one round structure (draft, tree build, verify, commit) for all three.

Each round the target verifies a tree whose root is the last bonus token. Walking down from the root, the
target's own token at each node (argmax at temperature 0, a sample from its distribution otherwise) picks
the child to follow; where no child carries that token the walk stops and that token is the next bonus.
Every emitted token is therefore the target's choice given its prefix, so the output is what AR decoding
gives at temperature 0 and follows the target's distribution at temperature > 0, whatever the draft says.
AR is the same loop with a tree of one node.

A prompt is prefilled once (`prefill`) and every method decodes from a copy of that state (`decode_from`),
so the prefill, which all methods share, is measured apart from the decoding that tells them apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from remote_worker.cache.hybrid_cache import HybridCache
from remote_worker.cache.tree import Tree
from remote_worker.decoding.emission import emit_round
from remote_worker.decoding.fixed_prefill import FixedPrefill
from remote_worker.decoding.fixed_round import FixedRound, choose, collect_margins, run_rounds
from remote_worker.decoding.tree_build import DraftTree, best_first_tree, chain_tree, grow_best_first
from remote_worker.models.target import TargetModel

if TYPE_CHECKING:  # `online_budget` reads node costs, which decode with this module
    from remote_worker.decoding.online_budget import OnlineBudget

METHODS = ("ar", "dflash", "ddtree")
STAGES = ("draft", "tree_build", "verify", "commit")


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance_lengths: list[int]  # drafted tokens accepted per round (bonus excluded)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    decode_seconds: float = 0.0  # the rounds, from the prefilled state to the last token (prefill excluded)
    first_token_seconds: float = 0.0  # from the start of decoding until the first token was known
    tree_sizes: list[int] = field(default_factory=list)
    # Per round, the accepted path below the root: its nodes' numbers in the tree (increasing: a tree lists
    # parents first), and each node's rank among its parent's draft candidates (0: the draft's first choice).
    # What `budget_curve` and `acceptance_profile` read; empty lists for AR, whose tree is its root.
    accepted_nodes: list[list[int]] = field(default_factory=list)
    accepted_ranks: list[list[int]] = field(default_factory=list)
    # With record_margins: per emitted token, the target's (top-1, top-2) logits where it chose that token.
    margins: list[tuple[float, float]] = field(default_factory=list)
    # Fixed-shape rounds: how many trees had a rounded score sum (`device_tree`), so that they may differ from
    # the host heap's tree at an exact tie (the tokens are the target's all the same).
    inexact_trees: int = 0
    fixed: bool = False  # decoded with fixed-shape rounds
    peak_memory_bytes: int | None = None  # the decode's peak (`peak_memory`), where the caller measured it

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round, bonus included."""
        return sum(a + 1 for a in self.acceptance_lengths) / max(self.rounds, 1)


@dataclass
class Prefill:
    """A prompt committed to the target's cache (all but its last token, which is the first round's root)
    and, with a drafter, to the drafter's context: the state every method's decoding starts from."""

    cache: HybridCache
    draft_context: Any | None  # the drafter's DraftContext (None: prefilled for AR only)
    root: int
    prompt_length: int
    target_seconds: float  # the target's prefill
    draft_seconds: float  # the drafter taking in the prompt's features

    def fork(self) -> tuple[HybridCache, Any | None]:
        """Independent copies of the cache and the drafter's context, for one decode."""
        context = self.draft_context.clone() if self.draft_context is not None else None
        return self.cache.clone(), context


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Per-stage wall time, synchronising the device so asynchronous CUDA work is charged to its stage."""

    def __init__(self, device: torch.device, result: DecodeResult) -> None:
        self.device, self.result = device, result

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        _sync(self.device)
        start = time.perf_counter()
        yield
        _sync(self.device)
        self.result.stage_seconds[name] += time.perf_counter() - start


def walk(draft: DraftTree, targets: list[int]) -> list[int]:
    """The accepted path (node indices from the root) given the target's token at every node."""
    path = [0]
    while (child := draft.children[path[-1]].get(targets[path[-1]])) is not None:
        path.append(child)
    return path


def prefill(
    target: TargetModel, prompt: torch.Tensor, drafter: Any | None = None, prefiller: FixedPrefill | None = None
) -> Prefill:
    """Commit all but the last prompt token; with a drafter, give it their target features too. With a
    `prefiller` (fixed-shape chunks, built for the drafter's feature layers), the prefill goes through it and
    the returned state's cache is the prefiller's own, valid until its next prompt."""
    if prompt.shape[0] < 2:
        raise ValueError("the prompt needs at least two tokens (a committed prefix and the first root)")
    feature_layers = drafter.feature_layers if drafter is not None else ()
    if prefiller is not None and feature_layers not in ((), prefiller.hidden_layers):
        raise ValueError(f"the prefiller keeps layers {prefiller.hidden_layers}, the drafter reads {feature_layers}")
    _sync(target.device)
    started = time.perf_counter()
    if prefiller is not None:
        features = prefiller(prompt[:-1])
        cache = prefiller.cache
    else:
        prompt = prompt.to(target.device)
        cache = target.new_cache()
        features = target.prefill(cache, prompt[:-1], feature_layers)
    _sync(target.device)
    target_seconds = time.perf_counter() - started
    context = None
    if drafter is not None:
        context = drafter.new_context()
        if feature_layers:
            drafter.extend(context, features)
        _sync(target.device)
    draft_seconds = time.perf_counter() - started - target_seconds
    return Prefill(cache, context, int(prompt[-1]), int(prompt.shape[0]), target_seconds, draft_seconds)


def decode(target: TargetModel, prompt: torch.Tensor, *, method: str, drafter: Any | None = None, **options: Any):
    """Prefill `prompt` and decode it with one method (see `decode_from` for the options)."""
    start = prefill(target, prompt, None if method == "ar" else drafter)
    return decode_from(target, start, method=method, drafter=drafter, **options)


def decode_from(
    target: TargetModel,
    start: Prefill,
    *,
    method: str,
    max_new_tokens: int,
    drafter: Any | None = None,
    budget: int = 0,
    temperature: float = 0.0,
    stop_tokens: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    record_margins: bool = False,
    rounds: FixedRound | None = None,
    online: OnlineBudget | None = None,
) -> DecodeResult:
    """Decode up to `max_new_tokens` from a copy of the prefilled state `start` (which stays as it is).

    `rounds`: decode with that fixed-shape round on the device (`fixed_round`; built for this method, budget
    and temperature) instead of this module's reference round. `online` (DDTree only): each round grows the
    tree to `budget` and verifies the first n nodes the policy chooses (`online_budget`), then tells it what
    was accepted."""
    if online is not None and (method != "ddtree" or rounds is not None):
        raise ValueError("a per-round budget is DDTree's, on the reference round")
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    drafting = method != "ar"
    if drafting and (drafter is None or start.draft_context is None):
        raise ValueError(f"method={method!r} needs a drafter and a prefill that fed it the prompt")
    if rounds is not None:
        if (rounds.method, rounds.budget, rounds.temperature) != (method, budget, temperature):
            raise ValueError("the fixed-shape round was built for another method, budget or temperature")
        return _decode_fixed(target, start, rounds, generator, max_new_tokens, stop_tokens, record_margins)
    cache, context = start.fork()
    # Room for every token this decode can commit and the largest tree past them: no buffer grows mid-decode.
    widest = 1 + (max(budget, drafter.block_size) if drafting else 0)
    cache.reserve(start.prompt_length + max_new_tokens + widest)
    if context is not None:
        context.reserve(start.prompt_length + max_new_tokens + widest)
    feature_layers = drafter.feature_layers if drafting else ()
    mask_embedding = target.embed(torch.tensor(drafter.mask_token_id, device=target.device)) if drafting else None
    result = DecodeResult(tokens=[], acceptance_lengths=[])
    timer = _Timer(target.device, result)
    root = start.root
    root_on_device = torch.tensor(root, device=target.device)  # later rounds take it from the target's choices
    margins: list[torch.Tensor] = []
    _sync(target.device)
    started = time.perf_counter()
    while len(result.tokens) < max_new_tokens:
        if not drafting:
            draft = DraftTree(tree=Tree.chain(torch.tensor([root])), children=[{}], scores=[0.0], ranks=[0])
        else:
            with timer.stage("draft"):
                root_embedding = target.embed(root_on_device)
                logits = drafter.propose(context, root_embedding, mask_embedding, target.head)
            with timer.stage("tree_build"):
                if method == "dflash":
                    draft = chain_tree(root, logits, drafter.block_size - 1)
                elif online is not None:  # grown as far as the policy may want, assembled at the chosen size
                    grown = grow_best_first(root, logits, min(online.grow_to(), budget))
                    draft = grown.first(online.choose(grown))
                else:
                    draft = best_first_tree(root, logits, budget)
        with timer.stage("verify"):
            output = target.verify(cache, draft.tree, feature_layers)
            chosen = choose(output.logits, temperature, generator)
            targets = chosen.tolist()  # the round's one device→host transfer
        path = walk(draft, targets)
        if online is not None:
            online.observe(draft, path)
        with timer.stage("commit"):
            index = cache.commit(path)
        root_on_device = chosen[path[-1]]
        if feature_layers:
            with timer.stage("draft"):  # the drafter takes in the committed tokens' target features
                drafter.extend(context, torch.cat([output.hidden[i][index] for i in feature_layers], dim=-1))
        if record_margins:  # kept on the device; read after the clock stops
            margins.append(output.logits[index].topk(2, dim=-1).values)
        drafted = draft.tree.tokens.tolist()
        emitted = [drafted[i] for i in path[1:]] + [targets[path[-1]]]
        if not result.tokens:
            result.first_token_seconds = time.perf_counter() - started
        ranks = [draft.ranks[node] for node in path[1:]]
        if emit_round(result, emitted, path[1:], ranks, draft.tree.size, stop_tokens, max_new_tokens):
            break
        root = emitted[-1]
    _sync(target.device)
    result.decode_seconds = time.perf_counter() - started
    if margins:
        result.margins = [tuple(row) for row in torch.cat(margins).tolist()][: len(result.tokens)]
    return result


def _decode_fixed(
    target: TargetModel,
    start: Prefill,
    rounds: FixedRound,
    generator: torch.Generator | None,
    max_new_tokens: int,
    stop_tokens: frozenset[int],
    record_margins: bool,
) -> DecodeResult:
    """`decode_from` with fixed-shape rounds. No stage is timed apart: that would mean a sync per stage."""
    needed = start.prompt_length + max_new_tokens + max(rounds.nodes, rounds.slots)
    if needed > rounds.capacity:
        raise ValueError(f"this decode needs {needed} cache positions; the fixed-shape round has {rounds.capacity}")
    result = DecodeResult(tokens=[], acceptance_lengths=[], stage_seconds={}, fixed=True)
    rounds.reset(start.cache, start.draft_context, start.root, generator)
    _sync(target.device)
    started = time.perf_counter()
    kept = run_rounds(rounds, result, max_new_tokens, stop_tokens, record_margins)
    _sync(target.device)
    result.decode_seconds = time.perf_counter() - started
    result.margins = collect_margins(kept, len(result.tokens))
    return result


def fixed_capacity(prompt_length: int, max_new_tokens: int, block_size: int, budget: int) -> int:
    """The cache capacity of fixed-shape rounds for prompts up to `prompt_length` tokens: every token a decode
    can commit and the widest tree past them, rounded up to a multiple of 256 so that nearby prompt sets
    share compiled rounds."""
    needed = prompt_length + max_new_tokens + max(budget + 1, block_size)
    return -(-needed // 256) * 256
