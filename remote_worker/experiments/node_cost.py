"""`experiment=node_cost`: what a draft-tree node costs on this host, stage by stage, against tree size.

Target and draft are loaded as `ddtree_gdn` loads them (decode.block_size overrides the draft's block), the
context is filled with the first prompt of the experiment's prompt set (its tokens repeated or cut to
`experiment.context`), and `remote_worker.decoding.node_cost` times the round's four stages at tree sizes 1,
2, 4, … up to `experiment.max_size` nodes. MLflow gets each stage as a metric history whose step is the tree
size (`node_cost.verify_ms`, `_low`, `_high`; `node_cost.tree_ms`, `node_cost.commit_ms`,
`node_cost.round_ms`), the draft at step 0; `node_costs.json` holds the whole `NodeCosts` record.
"""

from __future__ import annotations

import json
import logging
import time

from remote_worker import stop_signal
from remote_worker.decoding.node_cost import (
    SPREAD,
    WARMUP,
    NodeCosts,
    StageCost,
    measure_node_costs,
    metric_steps,
    node_cost_sizes,
)
from remote_worker.decoding.tree_memory import budget_problem, free_bytes
from remote_worker.events import EventLog
from remote_worker.experiments.ddtree_gdn import load_pair, prompt_source
from remote_worker.models.loading import context_length, load_tokenizer
from remote_worker.models.target import TargetModel
from remote_worker.prompt_set import load_prompt_file
from remote_worker.prompts import encode
from remote_worker.safe_files import Folder
from remote_worker.spec import Spec
from remote_worker.wording import counted

LOG = logging.getLogger(__name__)
NODE_COSTS_FILE = "node_costs.json"
DEFAULTS = {"context": 256, "max_size": 256, "repeats": 10}
LONG_S = 120.0  # a measurement estimated longer than this says so before it starts


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def run_node_cost(spec: Spec, log: EventLog) -> dict[str, str]:
    _model, target, drafter = load_pair(spec, log)
    prompt = load_prompt_file(prompt_source(spec), 1)[0]
    ids = encode(prompt, load_tokenizer(spec.model), target.embed.num_embeddings)
    setting = spec.experiment.get("context", DEFAULTS["context"])
    context = int(setting) if setting is not None else ids.shape[0] - 1
    max_size = int(spec.experiment.get("max_size") or DEFAULTS["max_size"])
    repeats = int(spec.experiment.get("repeats") or DEFAULTS["repeats"])
    sizes = _sizes_that_fit(target, node_cost_sizes(max_size - 1, cap=max_size), context, drafter.block_size)
    log.emit(
        "params",
        {
            "node_cost.context": context,
            "node_cost.repeats": repeats,
            "node_cost.device": str(target.device),
            "node_cost.dtype": str(target.dtype).removeprefix("torch."),
            "node_cost.sizes": ", ".join(map(str, sizes)),
            "node_cost.block_size": drafter.block_size,
            "node_cost.prompt": prompt.id,
            "node_cost.spread": SPREAD,
        },
    )
    log.progress(
        "setup",
        2,
        2,
        f"{counted(context, 'token')} of context, {counted(len(sizes), 'tree size')} × {counted(repeats, 'repeat')}",
    )

    def progress(done: int, total: int, what: str) -> None:
        stop_signal.check()
        log.progress("measure", done, total, what)

    log.progress("measure", 0, sum(sizes) * (WARMUP + repeats), f"prefilling {context} tokens")  # in node-rounds

    def estimate(seconds: float, basis: str) -> None:
        """Said before the first timed round when it will be long: how long, and what sets it."""
        if seconds >= LONG_S:
            LOG.warning(
                "node_cost: measuring %d tree sizes up to %d nodes, %d rounds each, will take about %s on %s (%s); "
                "experiment.max_size sets the largest tree",
                len(sizes), sizes[-1], WARMUP + repeats, _duration(seconds), target.device, basis,
            )  # fmt: skip
        log.emit("params", {"node_cost.estimate_s": round(seconds, 1)})

    started = time.perf_counter()
    costs = measure_node_costs(target, drafter, ids, context, sizes, repeats, progress, estimate=estimate)
    log.emit("params", {"node_cost.measure_s": round(time.perf_counter() - started, 1)})  # the estimate's check
    if costs.unmeasured:
        LOG.warning("node_cost: tree sizes %s not measured: %s", costs.unmeasured, costs.note)
        log.emit("params", {"node_cost.unmeasured": ", ".join(map(str, costs.unmeasured))})
    for step, metrics in metric_steps(costs):
        log.emit("metrics", metrics, step=step)
    # The record (`NodeCosts.from_record` reads it back), with what it was measured on.
    document = {"model": spec.model.name, "dtype": str(target.dtype).removeprefix("torch."), **costs.as_record()}
    Folder(spec.run_dir).write_whole(NODE_COSTS_FILE, (json.dumps(document, indent=1) + "\n").encode())
    log.emit("artifact", {"path": NODE_COSTS_FILE})
    return terminal_summary(costs)


def _sizes_that_fit(target: TargetModel, sizes: list[int], context: int, block_size: int) -> list[int]:
    """The sizes whose tree the device can hold (`tree_memory`); a size it cannot is left out with a warning.
    The context and the draft block past it must fit the model's positions (a tree reaches no further than
    its block)."""
    limit = context_length(target.model)
    if limit is not None and context + block_size > limit:
        raise ValueError(
            f"experiment.context={context} and a draft block of {block_size} need {context + block_size} positions, "
            f"more than the model's context of {limit}"
        )
    free = free_bytes(target.device)
    fitting = [n for n in sizes if budget_problem(target, n - 1, context, free) is None]
    if not fitting:
        raise ValueError(f"not even a tree of one node fits {target.device}'s memory at {context} tokens of context")
    if len(fitting) < len(sizes):
        LOG.warning(
            "node_cost: trees of %s nodes do not fit %s's memory at %d tokens of context; measuring up to %d nodes",
            ", ".join(str(n) for n in sizes if n not in fitting), target.device, context, fitting[-1],
        )  # fmt: skip
    return fitting


def terminal_summary(costs: NodeCosts) -> dict[str, str]:
    """A few lines that fit a terminal: where it was measured, the draft, each stage at the smallest and the
    largest tree, and the round at the largest budget."""
    first, last, draft = costs.sizes[0], costs.sizes[-1], costs.draft
    calls = f"{counted(costs.repeats, 'call')}"

    def across(stage: list[StageCost]) -> str:  # medians (the ranges are in MLflow and node_costs.json)
        text = f"{counted(first, 'node')} {stage[0].median_ms:.3g} ms"
        return text if first == last else f"{text} → {last} nodes {stage[-1].median_ms:.3g} ms"

    lines = {
        "measured": f"{costs.device}, context {costs.context}, median of {calls}",
        "draft": f"{draft.median_ms:.3g} ms (fastest {draft.low_ms:.3g}, slowest {draft.high_ms:.3g})",
        "tree build": across(costs.tree),
        "verify": across(costs.verify),
        "commit": across(costs.commit),
        f"round at budget {costs.largest_budget}": f"{costs.round_ms(costs.largest_budget):.3g} ms",
    }
    if costs.unmeasured:
        lines["not measured"] = f"{', '.join(map(str, costs.unmeasured))} nodes: {costs.note}"
    return lines
