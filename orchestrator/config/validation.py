"""Config checks that run before anything is created: one clear line per mistake, naming key and allowed values."""

from __future__ import annotations

import difflib
import math
import os
import re
import shlex
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from orchestrator.config import host_values
from orchestrator.config.model_shape import model_shape, positive_int
from orchestrator.config.prompt_lengths import PromptTooShort, prompt_lengths
from orchestrator.config.prompts import resolve_prompts
from orchestrator.config.settings import SYNC_METHODS, JobConfig
from orchestrator.config.text import printable, shown
from remote_worker.decoding.tree_limits import beyond_draft
from remote_worker.decoding.two_phase import PROTOCOLS
from remote_worker.prompt_set import PromptSetError, round_trip
from remote_worker.spec import DEVICES, DTYPES, EXPERIMENT_NAMES, MODEL_SOURCES
from remote_worker.wording import counted

HOST_KINDS = ("local", "ssh")
# What a `???` left for the user means, in the line that asks for it.
MUST_GIVE = {"host.python": "the host's Python interpreter (its absolute path, e.g. /usr/bin/python3)"}
RUN_REF = re.compile(r"last|[0-9a-f]{1,32}")
TRACKING_SCHEMES = {"local": ("sqlite:///", "file:"), "server": ("http://", "https://")}


class ConfigError(ValueError):
    """A config mistake; the message is the single line shown to the user."""


class PromptsError(ConfigError):
    """A job's prompts cannot be decoded: the set cannot be read here, its file would not read back as written,
    or a prompt is too short. A sweep checks these for every job before its first (`sweep/precheck.py`)."""


def group_options(conf_dir: Path, group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_group_choices(args: Sequence[str], conf_dir: Path) -> None:
    """Reject `group=choice` overrides naming a config file that does not exist.

    Hydra would reject them too, but with a multi-line report; this names the key and its options in one line.
    Malformed overrides are left for Hydra to report.
    """
    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    parser = OverridesParser.create()
    try:
        overrides = parser.parse_overrides(candidates)
    except HydraException:
        for arg in candidates:  # the one Hydra cannot read, named in one line (its own report is a page)
            try:
                parser.parse_override(arg)
            except HydraException:
                key, _, value = arg.partition("=")
                raise ConfigError(
                    f"{shown(arg)} is not an override Hydra can read: quote the value for Hydra, as in "
                    f"\"{printable(key)}='{printable(value)[:40]}'\""
                ) from None
        return
    _check_known_keys([o for o in overrides if not (conf_dir / o.key_or_group).is_dir()], overrides, conf_dir)
    for override in overrides:
        group = override.key_or_group
        if override.package is not None or override.is_delete() or not (conf_dir / group).is_dir():
            continue
        allowed = group_options(conf_dir, group)
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [override.get_value_element_as_str()]
        for value in values:
            if value not in allowed:
                raise ConfigError(f"{group}={value!r} is not one of: {', '.join(allowed)}")


def _dotted_keys(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _dotted_keys(value, f"{prefix}{key}.")
    if prefix:
        yield prefix[:-1]


def _check_known_keys(plain: Sequence[Any], every: Sequence[Any], conf_dir: Path) -> None:
    """An override of a key the config does not have (a typo) is one line naming the closest key, instead
    of Hydra's multi-line report that suggests adding it with `+`."""
    candidates = [o for o in plain if o.package is None and not o.is_add() and not o.is_force_add()]
    candidates = [o for o in candidates if not o.key_or_group.startswith("hydra")]
    if not candidates:
        return
    from hydra import compose, initialize_config_dir

    group_overrides = [o for o in every if (conf_dir / o.key_or_group).is_dir()]
    fixed = [o.input_line for o in group_overrides if not o.is_sweep_override()]
    # A swept group (model=a,b) is composed once per choice: a key is known if any choice has it.
    variants = [
        [*fixed, f"{o.key_or_group}={value}"]
        for o in group_overrides
        if o.is_sweep_override()
        for value in o.sweep_string_iterator()
    ]
    known: set[str] = set()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            for overrides in variants or [fixed]:
                composed = compose(config_name="config", overrides=overrides)
                known |= set(_dotted_keys(OmegaConf.to_container(composed, resolve=False)))
    except HydraException:
        return  # a bad group choice is reported by the caller
    for override in candidates:
        key = override.key_or_group
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{key} is not a config key{hint}")


def _choice(cfg: dict[str, Any], key: str, allowed: Sequence[str]) -> Any:
    value = _get(cfg, key)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(allowed)}")
    return value


def _get(cfg: dict[str, Any], key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{key} is missing from the config")
        node = node[part]
    return node


def _number(cfg: dict[str, Any], key: str, *, minimum: float, integer: bool = False) -> float:
    value = _get(cfg, key)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < minimum:
        what = "an integer" if integer else "a finite number"
        raise ConfigError(f"{key}={value!r} must be {what} >= {minimum}")
    return value


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _host_value(key: str, value: Any, check: Callable[[Any], Any], what: str = "") -> None:
    """One host value through its schema (`host_values.py`, shared with the tags a run records)."""
    try:
        check(value)
    except ValueError as exc:
        shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:80]}…"
        raise ConfigError(f"{key}={shown} {exc}{what}") from exc


def _check_ssh_host(container: dict[str, Any]) -> None:
    if not str(_get(container, "host.hostname") or "").strip():
        raise ConfigError("host.hostname must name the host (an address or a ~/.ssh/config alias)")
    _host_value("host.hostname", _get(container, "host.hostname"), host_values.hostname)
    python = _get(container, "host.python")
    if not str(python or "").startswith("/"):
        raise ConfigError(f"host.python={python!r} must be the absolute path of the host's Python")
    port = _get(container, "host.port")
    if port is not None:
        _host_value("host.port", port, host_values.port, " or null")
    for key in ("host.connect_timeout_s", "host.keepalive_s"):
        if _number(container, key, minimum=0) == 0:
            raise ConfigError(f"{key} must be > 0")
    count = _get(container, "host.keepalive_count_max")
    if not positive_int(count):
        raise ConfigError(f"host.keepalive_count_max={count!r} must be a whole number >= 1")
    _number(container, "host.reconnect_budget_s", minimum=0)
    _choice(container, "host.sync", SYNC_METHODS)
    if not isinstance(_get(container, "host.accept_new_host_key"), bool):
        raise ConfigError("host.accept_new_host_key must be true or false")
    for key, meaning in (("user", "a user name"), ("identity_file", "a key file"), ("proxy_jump", "a host")):
        value = container["host"].get(key)  # optional: null (or empty) leaves it to ~/.ssh/config
        if isinstance(value, (bool, dict, list)):
            raise ConfigError(f"host.{key}={value!r} must be null or {meaning}")
    for key, check in (("user", host_values.user), ("proxy_jump", host_values.gateway)):
        value = container["host"].get(key)
        if value not in (None, ""):
            _host_value(f"host.{key}", value, check)
    known_hosts = container["host"].get("known_hosts")
    if not isinstance(known_hosts, str) or not known_hosts.strip():
        raise ConfigError(f"host.known_hosts={known_hosts!r} must be the path of a known_hosts file")


def _check_prompts(experiment: dict[str, Any]) -> None:
    """The prompt set is read here, so a bad file stops the run before anything is created."""
    if experiment.get("num_prompts") is not None:
        _number({"experiment": experiment}, "experiment.num_prompts", minimum=1, integer=True)
    if not isinstance(experiment.get("enable_thinking", False), bool):
        raise ConfigError(f"experiment.enable_thinking={experiment['enable_thinking']!r} must be true or false")
    shard = experiment.get("shard")
    if shard is not None:
        # ASCII digits, at most nine: `str.isdigit` takes `¹` and `int` a digit string only below 4,300 digits
        match = re.fullmatch(r"([0-9]{1,9})/([0-9]{1,9})", str(shard))
        if not (match and int(match[1]) < int(match[2])):
            raise ConfigError(
                f"experiment.shard={shown(shard)} must be i/n with 0 <= i < n (prompts i, i+n, …), or null"
            )
    datasets_dir = experiment.get("datasets_dir")
    if datasets_dir is not None and not isinstance(datasets_dir, str):
        raise ConfigError(f"experiment.datasets_dir={datasets_dir!r} must be a folder's path, or null (the hub)")
    value = experiment.get("prompts")
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"experiment.prompts={value!r} must be a named set or a path to a JSONL file")
    try:
        prompts = resolve_prompts(value, datasets_dir)
        if prompts is not None:  # the file the worker will read, read back here as the worker reads it
            round_trip(prompts, f"the prompt file of experiment.prompts={value}")
    except PromptSetError as exc:
        raise PromptsError(f"experiment.prompts: {exc}") from exc
    if shard is not None and prompts is not None:
        limit = experiment.get("num_prompts") or len(prompts)
        part = int(str(shard).split("/")[0])
        if part >= min(limit, len(prompts)):
            raise ConfigError(
                f"experiment.shard={shard} holds no prompt: the set has {counted(min(limit, len(prompts)), 'prompt')}"
            )


def _check_tree_budgets(container: dict[str, Any], budgets: list[int]) -> None:
    """A budget the model cannot hold, refused before launch where the config says why: its tree (or a draft
    block, whichever reaches further) must fit the context beside decode.max_new_tokens and the longest
    prompt, counted here where this machine has the tokenizer (`prompt_lengths.py`; else one token, and the
    host checks them all before the first), and a draft block must be able to offer that many nodes. What
    the device can hold is checked on the host, before the first prompt. A prompt too short to decode is
    refused here too, naming its line."""
    shape = model_shape(container)
    max_new = int(container["decode"]["max_new_tokens"])
    try:
        lengths = prompt_lengths(container, shape.vocab)
    except (PromptTooShort, PromptSetError) as exc:
        raise PromptsError(str(exc)) from exc
    longest = max(lengths, key=lambda p: p.tokens) if lengths else None
    prompt = longest.tokens if longest is not None else 1
    what = (
        f"the longest prompt ({longest.prompt_id!r}, {longest.tokens} tokens)" if longest is not None
        else "a prompt (of at least one token; the host counts them)"
    )  # fmt: skip
    block = shape.block_size or 0
    for budget in sorted(budgets, reverse=True):
        if shape.context is not None and prompt + max_new + max(budget + 1, block) > shape.context:
            largest = shape.context - prompt - max_new - 1
            fits = largest >= 1 and prompt + max_new + block <= shape.context
            room = shape.context - prompt - max(2, block)  # the new tokens a budget-1 tree would leave room for
            if fits:
                fix = f"the largest budget that fits is {largest}"
            elif room >= 1:
                fix = f"lower decode.max_new_tokens to at most {room}"
            else:
                where = f" ({longest.where})" if longest is not None else ""
                fix = f"that prompt alone does not fit: shorten it or leave it out of the prompt set{where}"
            raise ConfigError(
                f"decode.tree_budgets: budget {budget} needs {budget + 1} positions for its tree beside "
                f"decode.max_new_tokens={max_new} and {what}, more than model {shape.name}'s context of "
                f"{shape.context}; {fix}"
            )
        if shape.block_size is not None and shape.vocab is not None:
            problem = beyond_draft(budget, shape.block_size, shape.vocab)
            if problem is not None:
                raise ConfigError(problem)


def _check_node_cost(container: dict[str, Any], launching: bool) -> None:
    """experiment=node_cost's settings; before launch, its context and a draft block past it must fit the
    model's context where the config says it (tree sizes the draft or the device cannot hold are left out
    by the worker, which says so)."""
    experiment = {"experiment": container["experiment"]}
    context = container["experiment"].get("context")
    if context is not None and not positive_int(context):
        raise ConfigError(f"experiment.context={context!r} must be null (the prompt's own length) or an integer >= 1")
    _number(experiment, "experiment.max_size", minimum=1, integer=True)
    if _number(experiment, "experiment.repeats", minimum=1, integer=True) > 1000:
        raise ConfigError("experiment.repeats must be at most 1000")
    if not launching or context is None:
        return
    shape = model_shape(container)
    if shape.context is not None and shape.block_size is not None and context + shape.block_size > shape.context:
        raise ConfigError(
            f"experiment.context={context} and a draft block of {shape.block_size} need "
            f"{context + shape.block_size} positions, more than model {shape.name}'s context of {shape.context}"
        )


def resolve_config(cfg: DictConfig) -> dict[str, Any]:
    """Resolve interpolations and check every value the orchestrator and the worker rely on."""
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:  # `???` in a config file: a value only the user can give
        key = getattr(exc, "full_key", None) or "config"
        what = MUST_GIVE.get(key, "a value")
        raise ConfigError(f"{key} has no value in this config: give {what} on the command line ({key}=...)") from exc
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(exc).splitlines()[0]}") from exc
    assert isinstance(container, dict)
    if _choice(container, "host.kind", HOST_KINDS) == "ssh":
        _check_ssh_host(container)
    gpus = _get(container, "host.gpus")
    if gpus not in ("auto", "none") and not (isinstance(gpus, list) and all(_index(g) for g in gpus)):
        raise ConfigError(f"host.gpus={gpus!r} must be auto, none or a list of GPU indices")
    for key in ("host.workdir", "host.gpu_lock_dir"):
        if not str(_get(container, key)).startswith("/"):
            raise ConfigError(f"{key}={_get(container, key)!r} must be an absolute path")
    _host_value("host.workdir", _get(container, "host.workdir"), host_values.folder)
    python = _get(container, "host.python")
    if python is not None and not str(python).strip():
        raise ConfigError("host.python must be null (this interpreter) or a path to a Python interpreter")
    env = _get(container, "host.env")
    if not isinstance(env, dict) or not all(str(k).isidentifier() for k in env):
        raise ConfigError(f"host.env must map environment variable names to values, got {env!r}")
    source = _choice(container, "model.source", MODEL_SOURCES)
    if source == "pretrained" and not _get(container, "model.path"):
        raise ConfigError("model.path must name a checkpoint directory when model.source='pretrained'")
    _choice(container, "model.dtype", DTYPES)
    _choice(container, "model.device", DEVICES)
    _choice(container, "experiment.name", EXPERIMENT_NAMES)
    kind = _choice(container, "tracking.kind", tuple(TRACKING_SCHEMES))
    uri = str(_get(container, "tracking.uri"))
    if not uri.startswith(TRACKING_SCHEMES[kind]):
        schemes = " or ".join(f"{s}..." for s in TRACKING_SCHEMES[kind])
        raise ConfigError(f"tracking.uri={uri!r} must start with {schemes} for tracking={kind}")
    if uri.startswith("file:") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        # MLflow 3.x refuses to open one (its message, a paragraph, surfaced as a crash with a traceback file)
        folder = uri.removeprefix("file://").removeprefix("file:").rstrip("/") or "."
        instead = shlex.quote(f"tracking.uri=sqlite:///{folder}/mlflow.db")
        raise ConfigError(
            f"tracking.uri={uri!r}: this MLflow no longer writes file stores; give {instead} (`mlflow "
            "migrate-filestore` moves an existing one there), or set MLFLOW_ALLOW_FILE_STORE=true"
        )
    if _number(container, "seed", minimum=0, integer=True) >= 2**64:
        raise ConfigError(f"seed={container['seed']} must be below 2**64 (a 64-bit seed)")
    for key in ("attach", "cancel", "logs"):
        run_ref = _get(container, key)
        if isinstance(run_ref, int) and not isinstance(run_ref, bool):
            run_ref = container[key] = str(run_ref)  # an all-digit prefix reads as a number
        if run_ref is not None and not (isinstance(run_ref, str) and RUN_REF.fullmatch(run_ref)):
            quote = f" (a prefix such as 3e8 reads as a number: quote it, {key}=\"'3e8'\")" * isinstance(run_ref, float)
            raise ConfigError(
                f"{key}={run_ref!r} must name a run: its MLflow run id, a unique prefix of it (hexadecimal), or last"
                + quote
            )
    pool = _get(container, "sweep.hosts")
    if not isinstance(pool, list) or not all(isinstance(name, str) and name for name in pool):
        raise ConfigError(f"sweep.hosts={pool!r} must be a list of host config names (conf/host/)")
    for key in ("detach", "follow", "sweep.fail_fast", "sweep.dry_run", "yes"):
        if not isinstance(_get(container, key), bool):
            raise ConfigError(f"{key} must be true or false")
    if _get(container, "list") not in (True, False, "all"):
        raise ConfigError(f"list={container['list']!r} must be true (active runs), all, or false")
    chosen = [k for k in ("attach", "cancel", "logs", "list", "detach") if container[k] not in (None, False)]
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)} cannot be combined: choose one")
    prefill = _number(container, "probe.prefill_tokens", minimum=2, integer=True)
    crop = _number(container, "probe.crop_tokens", minimum=1, integer=True)
    if crop >= prefill:
        raise ConfigError(f"probe.crop_tokens={crop} must be smaller than probe.prefill_tokens={prefill}")
    _number(container, "probe.tree_size", minimum=1, integer=True)
    _number(container, "decode.temperature", minimum=0)
    _number(container, "decode.max_new_tokens", minimum=1, integer=True)
    budgets = _get(container, "decode.tree_budgets")
    if not isinstance(budgets, list) or not budgets or not all(positive_int(b) for b in budgets):
        raise ConfigError(f"decode.tree_budgets={budgets!r} must be a non-empty list of positive integers")
    if len(set(budgets)) < len(budgets):
        twice = next(b for b in budgets if budgets.count(b) > 1)
        raise ConfigError(f"decode.tree_budgets={budgets!r} names budget {twice} twice: give each budget once")
    if _get(container, "decode.block_size") is not None:
        _number(container, "decode.block_size", minimum=2, integer=True)
    if _number(container, "decode.repeats", minimum=1, integer=True) > 1000:
        raise ConfigError("decode.repeats must be at most 1000")
    if not isinstance(_get(container, "decode.compile"), bool) and _get(container, "decode.compile") != "auto":
        raise ConfigError(f"decode.compile={_get(container, 'decode.compile')!r} must be true, false or auto")
    if not isinstance(_get(container, "decode.compile_cache"), bool):
        raise ConfigError(f"decode.compile_cache={_get(container, 'decode.compile_cache')!r} must be true or false")
    group = _get(container, "decode.compile_cache_group")
    if group is not None and not (isinstance(group, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", group)):
        raise ConfigError(f"decode.compile_cache_group={group!r} must be null (a private cache) or a group's name")
    protocol = _get(container, "decode.protocol")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"decode.protocol={shown(protocol)} must be one of {', '.join(PROTOCOLS)}")
    _number(container, "decode.sample_every", minimum=1, integer=True)
    online = _get(container, "decode.online_budget")
    if not isinstance(online, bool):
        raise ConfigError(f"decode.online_budget={shown(online)} must be true or false")
    if online and protocol != "grid":
        raise ConfigError("decode.online_budget=true needs decode.protocol=grid (two phases decode one chosen budget)")
    if not isinstance(_get(container, "decode.node_costs"), bool):
        raise ConfigError(f"decode.node_costs={_get(container, 'decode.node_costs')!r} must be true or false")
    if _number(container, "decode.node_cost_repeats", minimum=1, integer=True) > 1000:
        raise ConfigError("decode.node_cost_repeats must be at most 1000")
    _check_prompts(container["experiment"])
    launching = not any(container[k] not in (None, False) for k in ("attach", "cancel", "logs", "list"))
    if launching and container["experiment"]["name"] == "ddtree_gdn":
        _check_tree_budgets(container, budgets)
    if container["experiment"]["name"] == "node_cost":
        _check_node_cost(container, launching)
    if _number(container, "orchestrator.poll_interval_s", minimum=0) == 0:
        raise ConfigError("orchestrator.poll_interval_s must be > 0")
    _number(container, "orchestrator.kill_grace_s", minimum=0)
    for key in ("orchestrator.start_timeout_s", "orchestrator.stall_warning_s", "tracking.timeout_s"):
        if _number(container, key, minimum=0) == 0:
            raise ConfigError(f"{key} must be > 0")
    _number(container, "tracking.outage_wait_s", minimum=0)
    return container


def validate(cfg: DictConfig) -> JobConfig:
    """The checked config, typed: what every command reads from here on."""
    return JobConfig.from_resolved(resolve_config(cfg))
