"""AR, DFlash and DDTree decoding: one round structure (draft, tree build, verify, commit) for all three.

Each round the target verifies a tree whose root is the last bonus token. Walking down from the root, the
target's own token at each node (argmax at temperature 0, a sample from its distribution otherwise) picks
the child to follow; where no child carries that token the walk stops and that token is the next bonus.
Every emitted token is therefore the target's choice given its prefix, so the output is what AR decoding
gives at temperature 0 and follows the target's distribution at temperature > 0, whatever the draft says.
AR is the same loop with a tree of one node.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from remote_worker.cache.tree import Tree
from remote_worker.decoding.tree_build import DraftTree, best_first_tree, chain_tree
from remote_worker.models.dflash import DFlashDraft
from remote_worker.models.target import TargetModel

METHODS = ("ar", "dflash", "ddtree")
STAGES = ("draft", "tree_build", "verify", "commit")


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    acceptance_lengths: list[int]  # drafted tokens accepted per round (bonus excluded)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0  # from the start of the call until the first token was known
    total_seconds: float = 0.0
    tree_sizes: list[int] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round, bonus included."""
        return sum(a + 1 for a in self.acceptance_lengths) / max(self.rounds, 1)


class _Timer:
    """Per-stage wall time, synchronising the device so asynchronous CUDA work is charged to its stage."""

    def __init__(self, device: torch.device, result: DecodeResult) -> None:
        self.device, self.result = device, result

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.result.stage_seconds[name] += time.perf_counter() - start


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token at each row: argmax at temperature 0, else a sample from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0]


def walk(draft: DraftTree, targets: list[int]) -> list[int]:
    """The accepted path (node indices from the root) given the target's token at every node."""
    path = [0]
    while (child := draft.children[path[-1]].get(targets[path[-1]])) is not None:
        path.append(child)
    return path


def decode(
    target: TargetModel,
    prompt: torch.Tensor,
    *,
    method: str,
    max_new_tokens: int,
    drafter: DFlashDraft | None = None,
    budget: int = 0,
    temperature: float = 0.0,
    stop_tokens: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> DecodeResult:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if method != "ar" and drafter is None:
        raise ValueError(f"method={method!r} needs a drafter")
    result = DecodeResult(tokens=[], acceptance_lengths=[])
    timer = _Timer(target.device, result)
    feature_layers = drafter.feature_layers if drafter is not None and method != "ar" else ()
    started = time.perf_counter()
    cache = target.new_cache()
    prompt = prompt.to(target.device)
    # Commit all but the last prompt token; the last one is the first round's root.
    if prompt.shape[0] < 2:
        raise ValueError("the prompt needs at least two tokens (a committed prefix and the first root)")
    features = target.prefill(cache, prompt[:-1], feature_layers)
    if feature_layers:
        assert drafter is not None
        drafter.reset()
        drafter.extend_context(features)
    result.prefill_seconds = time.perf_counter() - started
    root = int(prompt[-1])
    mask_embedding = target.embed(torch.tensor(drafter.mask_token_id, device=target.device)) if drafter else None
    while len(result.tokens) < max_new_tokens:
        if method == "ar":
            draft = DraftTree(tree=Tree.chain(torch.tensor([root])), children=[{}], scores=[0.0])
        else:
            assert drafter is not None and mask_embedding is not None
            with timer.stage("draft"):
                root_embedding = target.embed(torch.tensor(root, device=target.device))
                log_probs = drafter.propose(root_embedding, mask_embedding, target.head)
            with timer.stage("tree_build"):
                if method == "dflash":
                    draft = chain_tree(root, log_probs, drafter.block_size - 1)
                else:
                    draft = best_first_tree(root, log_probs, budget)
        with timer.stage("verify"):
            output = target.verify(cache, draft.tree, feature_layers)
            targets = choose(output.logits, temperature, generator).tolist()
        path = walk(draft, targets)
        with timer.stage("commit"):
            cache.commit(path)
        if feature_layers:
            assert drafter is not None
            with timer.stage("draft"):  # the drafter takes in the committed tokens' target features
                index = torch.as_tensor(path, device=target.device)
                drafter.extend_context(torch.cat([output.hidden[i][index] for i in feature_layers], dim=-1))
        result.tree_sizes.append(draft.tree.size)
        result.acceptance_lengths.append(len(path) - 1)
        emitted = [int(draft.tree.tokens[i]) for i in path[1:]] + [targets[path[-1]]]
        if not result.tokens:
            result.first_token_seconds = time.perf_counter() - started
        done = False
        for token in emitted:
            result.tokens.append(token)
            if token in stop_tokens or len(result.tokens) >= max_new_tokens:
                done = True
                break
        if done:
            break
        root = emitted[-1]
    result.total_seconds = time.perf_counter() - started
    return result
