"""What a decode round asks of the device, counted: deterministic gates where timings would be noise.

Host→device copies are counted on the `meta` device (every operation taking a host tensor and giving a
device one would be a copy on a GPU, and each blocks the stream); compute operations on the CPU. The
figures for the 64-layer models are in `make bench`; these gates use fewer layers to stay fast, and check
that what grows with depth grows only where it must.
"""

from __future__ import annotations

import pytest
import torch

from bench.op_counts import PREFILL, _tree, build, host_copies, round_counts
from remote_worker.models.target import TargetModel
from remote_worker.op_count import count_operations

pytestmark = pytest.mark.worker


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_a_round_copies_from_the_host_once_for_the_tree_and_once_for_the_path(kind: str) -> None:
    verify, commit = host_copies(kind, layers=8)
    assert (verify, commit) == (1, 1)
    assert host_copies(kind, layers=16) == (1, 1)  # none per layer


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_commit_costs_the_same_at_any_depth_and_verify_stays_below_the_models_own_step(kind: str) -> None:
    shallow, deep = round_counts(kind, layers=4), round_counts(kind, layers=8)
    assert deep.commit == shallow.commit <= 20
    assert deep.verify_64 < deep.eager_step and deep.verify_1 < deep.eager_step


def _verify_counts(kind: str, layers: int, sizes: tuple[int, ...]) -> list[int]:
    target = TargetModel(build(kind, "cpu", layers))
    cache = target.new_cache()
    target.prefill(cache, torch.randint(0, 512, (PREFILL // 4,), generator=torch.Generator().manual_seed(0)))
    return [count_operations(lambda n=n: target.verify(cache, _tree(n, 512))).compute for n in sizes]


def test_a_layer_costs_the_same_operations_for_any_tree() -> None:
    """Nothing in a layer loops over nodes: four more layers cost as many operations for a 16-node tree as
    for a 128-node one (what depends on the tree, such as the ancestor mask, is built once per round)."""
    shallow, deep = _verify_counts("hybrid", 4, (16, 128)), _verify_counts("hybrid", 8, (16, 128))
    assert deep[0] - shallow[0] == deep[1] - shallow[1]


def test_a_compiler_that_fails_leaves_the_rounds_eager_and_says_why(monkeypatch) -> None:
    """decode.compile on a host whose torch cannot compile: the run goes on with the reference rounds, and
    the reason names the method whose round failed."""
    from remote_worker.decoding.comparison import methods_for
    from remote_worker.decoding.compiled import compile_rounds
    from tests.tiny_models import random_prompt, tiny

    target, draft = tiny("tiny_hybrid")

    def broken(function, **options):
        def run(*args, **kwargs):
            raise RuntimeError("no C++ compiler on this host\nmore detail")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    outcome = compile_rounds(target, draft, methods_for([4]), random_prompt(0), 16, 8)
    assert outcome == "prefill: RuntimeError: no C++ compiler on this host"
