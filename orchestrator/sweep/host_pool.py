"""`sweep.hosts`: a pool of hosts. Each job takes a host with a free GPU lease, the least loaded first, or waits
for the first lease freed anywhere in the pool.

The choice is made in the job's own process, before its config is checked and its run created (the run is the
host's: its tags, its params, its default model). Every host of the pool is looked at through
`host/leases.py`: its leases tried without blocking, under the host's pool lock, and the first free one
claimed for this job until its supervisor leases it. The leases themselves stay the per-GPU `flock`s every
user and orchestrator of a host shares, so several sweeps (and single runs) share a pool as they share a host.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from orchestrator.config.handover import read_whole, write_whole
from orchestrator.config.settings import JobConfig
from orchestrator.config.validation import ConfigError, validate
from orchestrator.host.connect import transport_for
from orchestrator.host.leases import Leases, ProbeFailed, probe_leases
from orchestrator.host.transport import CONNECTION_ERRORS, ConnectFailed, HostKeyRefused, Transport
from orchestrator.sweep.membership import Sweep, current_sweep

POLL_S = 1.0  # between two looks at the pool while every GPU of it is leased
TURN_POLL_S = 0.05  # between two looks at the sweep's queue while a job ahead chooses (local files)
# A claim lasts this much longer than orchestrator.start_timeout_s: the connect, preflight and sync before it.
CLAIM_MARGIN_S = 60.0


class HostUnreachable(Exception):
    """A host of the pool could not be looked at; the message names it and says why."""


Probe = Callable[[int, bool], "Leases | None"]  # (host index, claim) → its leases; None: look again later


def waiting_line(names: Sequence[str]) -> str:
    return f"every GPU of the pool ({', '.join(names)}) is leased; waiting for one to be free"


def choose_host(
    names: Sequence[str],
    probe: Probe,
    say: Callable[[str], None],
    *,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
    stopped: Callable[[], bool] = lambda: False,
    my_turn: Callable[[], bool] = lambda: True,
) -> tuple[int, Leases] | None:
    """The host a job takes, as (its index in `names`, its leases with the claim); None when `stopped` said so
    while waiting.

    Hosts are looked at, then tried in order of their load (busy and claimed leases; ties in pool order): the
    first with a free GPU is claimed (a claim that another job's beat is passed over). A free GPU is left to
    the jobs ahead of this one (`my_turn` false: an earlier job of the sweep still choosing), looking again
    as soon as they have chosen. Every GPU busy or claimed: one line says so, and the pool is looked at again
    every `poll_s` (±25 %, so that waiting jobs do not all ask at once). A host that cannot be reached is left
    out with one line; none left is a ConfigError naming each host's reason."""
    alive = list(range(len(names)))
    reasons: dict[int, str] = {}
    said_waiting = False

    def look(index: int, claim: bool) -> Leases | None:
        try:
            return probe(index, claim)
        except HostUnreachable as exc:
            reasons[index] = str(exc)
            alive.remove(index)
            say(f"{exc}; left out of the pool for this job")
            return None

    while True:
        looks = {i: found for i in list(alive) if (found := look(i, False)) is not None}
        if not alive:
            raise ConfigError("sweep.hosts: no host of the pool could be reached (" + "; ".join(reasons.values()) + ")")
        order = [i for i in sorted(looks, key=lambda i: (looks[i].load, i)) if looks[i].available]
        if order and not my_turn():
            if _wait_for_turn(my_turn, stopped, sleep, poll_s):
                return None
            continue
        for index in order:
            claimed = look(index, True) if index in alive else None
            if claimed is not None and claimed.claimed is not None:
                return index, claimed
        if not alive:
            continue  # the claims lost every host: say so, as above
        if not said_waiting:
            say(waiting_line([names[i] for i in alive]))
            said_waiting = True
        if stopped():
            return None
        sleep(poll_s * random.uniform(0.75, 1.25))


def _wait_for_turn(
    my_turn: Callable[[], bool], stopped: Callable[[], bool], sleep: Callable[[float], None], poll_s: float
) -> bool:
    """Wait (at most `poll_s`) until the jobs ahead have chosen; True when `stopped` said so meanwhile."""
    for _ in range(max(1, int(poll_s / TURN_POLL_S))):
        if stopped():
            return True
        if my_turn():
            return False
        sleep(TURN_POLL_S)
    return False


class Turns:
    """First come, first served among the jobs of one sweep: job N claims a GPU only once every job before it
    has chosen its host, so jobs start in grid order wherever the launcher runs them (put the longest first
    for the shortest sweep). A marker per job in `folder`: "waiting <machine> <pid> <pool>" while it chooses,
    "done" after. A job before this one that has not come yet is waited for `arrival_grace_s` at most (its
    launcher starts it before this one); one whose process has died on this machine, or that chooses from
    another pool (a sweep over `sweep.hosts` itself), is passed over."""

    def __init__(self, folder: Path, number: int, pool: Sequence[str] = (), arrival_grace_s: float = 30.0) -> None:
        self.folder = folder
        self.number = number
        self.pool = ",".join(pool) or "-"
        self.arrival_grace_s = arrival_grace_s
        self._since = time.monotonic()
        self._passed = 0  # every job below this one is done

    def _mark(self, text: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_whole(self.folder / str(self.number), text + "\n")

    def enter(self) -> None:
        self._mark(f"waiting {socket.gethostname()} {os.getpid()} {self.pool}")

    def leave(self) -> None:
        self._mark("done")

    def my_turn(self) -> bool:
        for earlier in range(self._passed, self.number):
            try:
                words = (read_whole(self.folder / str(earlier)) or "").split()
            except OSError:
                words = []
            if not words and time.monotonic() - self._since < self.arrival_grace_s:
                return False  # not come yet
            ahead = bool(words) and words[0] == "waiting" and not _gone(words)
            if ahead and words[3:4] in ([self.pool], []):
                return False
            if earlier == self._passed and not ahead:
                self._passed = earlier + 1
        return True


def _gone(words: list[str]) -> bool:
    """A waiting job's marker whose process has died on this machine."""
    if len(words) < 3 or words[1] != socket.gethostname() or not words[2].isdigit():
        return False
    try:
        os.kill(int(words[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


@dataclass
class _Pool:
    """The pool's hosts as this job would run on each: their configs, and a connection to each once looked at."""

    names: list[str]
    composed: list[DictConfig]
    configs: list[JobConfig]
    transports: dict[int, Transport] = field(default_factory=dict)

    def probe(self, index: int, claim: bool) -> Leases | None:
        config, name = self.configs[index], self.names[index]
        host = config.host
        claim_s = config.orchestrator.start_timeout_s + CLAIM_MARGIN_S
        try:
            if index not in self.transports:
                transport = transport_for(host)
                self.transports[index] = transport
                transport.open()
            return probe_leases(self.transports[index], host.gpus, host.gpu_lock_dir, host.workdir, claim_s, claim)
        except ProbeFailed as exc:
            if exc.transient:
                return None
            raise HostUnreachable(f"{name}: {exc}") from exc
        except (ConnectFailed, HostKeyRefused, *CONNECTION_ERRORS) as exc:
            raise HostUnreachable(f"{name}: {exc}") from exc

    def close(self) -> None:
        for transport in self.transports.values():
            with contextlib.suppress(*CONNECTION_ERRORS):  # a connection that will not close cleanly is closed enough
                transport.close()


def _compose(hydra_cfg: DictConfig, name: str) -> DictConfig:
    """The job's config with `host=name`: `host.*` overrides apply to every host of the pool."""
    from hydra import compose
    from hydra.errors import MissingConfigException

    try:
        # The search path of this app (hydra.searchpath) must be given again, or added config folders are unseen.
        searchpath = [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.searchpath=")]
        overrides = [*searchpath, *hydra_cfg.overrides.task, f"host={name}"]
        return compose(config_name=hydra_cfg.job.config_name, overrides=overrides)
    except MissingConfigException as exc:
        raise ConfigError(f"sweep.hosts: no host config named {name!r} (conf/host/{name}.yaml)") from exc


def assign_host(cfg: DictConfig) -> DictConfig:
    """In a multirun with `sweep.hosts`, the job's config composed again with the host it takes (see
    `choose_host`); the GPU it claimed there comes first in `host.gpus`, so its supervisor leases that one."""
    pool = [str(name) for name in (cfg.sweep.get("hosts") or [])]
    hydra_cfg = HydraConfig.get()
    if not pool or hydra_cfg.mode != RunMode.MULTIRUN:
        return cfg
    number = int(hydra_cfg.job.num)
    sweep = _sweep()
    turns = Turns(sweep.dir / f"host_pool-{sweep.parent_run_id}", number, pool) if sweep is not None else None
    hosts: _Pool | None = None

    def say(line: str) -> None:
        print(f"sweep job #{number}: {line}", flush=True)

    def stopped() -> bool:
        return sweep is not None and sweep.cancelled() is not None

    try:
        if turns is not None:
            turns.enter()
        composed = [_compose(hydra_cfg, name) for name in pool]
        # A mistake in any host's config is one now, before anything is claimed.
        hosts = _Pool(pool, composed, [validate(c) for c in composed])
        my_turn = turns.my_turn if turns is not None else lambda: True
        choice = choose_host(pool, hosts.probe, say, stopped=stopped, my_turn=my_turn)
    except KeyboardInterrupt:  # while waiting: the job ends as one of a sweep interrupted before it started
        if sweep is None or hosts is None:
            raise
        sweep.cancel("the sweep was interrupted (Ctrl-C)")
        choice = None
    finally:
        if turns is not None:
            turns.leave()  # first: the next job of the sweep may choose now
        if hosts is not None:
            hosts.close()
    if choice is None:  # the sweep was cancelled while this job waited: it ends without starting
        return hosts.composed[0]
    index, leases = choice
    chosen = hosts.composed[index]
    if isinstance(leases.claimed, int):
        chosen.host.gpus = [leases.claimed, *(g for g in leases.gpus if g != leases.claimed)]
    return chosen


def _sweep() -> Sweep | None:
    """The job's sweep, to see it cancelled while the job waits; None where its folder cannot be read."""
    try:
        return current_sweep(fail_fast=False)
    except (OSError, ValueError, KeyError):
        return None
