"""`sweep.hosts`: spread a multirun's jobs over a pool of hosts, job N on hosts[N % len]."""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from orchestrator.config.validation import ConfigError


def assign_host(cfg: DictConfig) -> DictConfig:
    """In a multirun with `sweep.hosts`, job N runs on `sweep.hosts[N % len]`.

    The job's config is composed again with that host, so `host.*` overrides apply to every host of the
    pool; GPU leases then spread the jobs a host receives over its GPUs."""
    pool = [str(name) for name in (cfg.sweep.get("hosts") or [])]
    hydra_cfg = HydraConfig.get()
    if not pool or hydra_cfg.mode != RunMode.MULTIRUN:
        return cfg
    from hydra import compose
    from hydra.errors import MissingConfigException

    name = pool[int(hydra_cfg.job.num) % len(pool)]
    try:
        # The search path of this app (hydra.searchpath) must be given again, or added config folders are unseen.
        searchpath = [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.searchpath=")]
        overrides = [*searchpath, *hydra_cfg.overrides.task, f"host={name}"]
        return compose(config_name=hydra_cfg.job.config_name, overrides=overrides)
    except MissingConfigException as exc:
        raise ConfigError(f"sweep.hosts: no host config named {name!r} (conf/host/{name}.yaml)") from exc
