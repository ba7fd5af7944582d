"""The host's load while the worker runs, sampled every few seconds and sent as metrics under MLflow's own
system-metric names (`system/cpu_utilization_percentage`, `system/gpu_0_memory_usage_megabytes`, …), so the
run page's System metrics tab shows the GPU box the worker ran on, not the machine the orchestrator ran on.

CPU and memory come from the standard library and /proc (Linux); the GPUs from `nvidia-smi` where it is
installed: the ones `CUDA_VISIBLE_DEVICES` leaves the worker where it lists indices, in `nvidia-smi`'s order
(torch's where they ascend; with UUIDs or MIG devices there, every GPU of the host). Two figures are
ours, beside MLflow's: `system/load_average` (one minute) and `system/other_processes_cpu_percentage`, the
share of the host's CPU time that other processes took: a speed measured while they took much of it is not
the host's speed, and the decode experiment's page says so (`LoadSummary.busy`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from remote_worker.events import EventLog

LOG = logging.getLogger(__name__)
EVERY_S = 3.0  # between samples (MLflow's own monitor takes 10 s; a decode of a few prompts is shorter)
BUSY_SHARE = 25.0  # % of the host's CPU time taken by other processes, on average, that makes a host busy
GPU_QUERY = "utilization.gpu,memory.used,memory.total,power.draw,power.limit"
MB = 1 << 20


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of the whole host since boot, summed over its CPUs; None off Linux. Whole
    ticks, so that busy over total, both differences of integers, is never above 1 by a rounding."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def _memory_mb() -> tuple[float, float] | None:
    """(used, total) MB: MemTotal less MemAvailable, as MLflow's monitor counts it; None off Linux."""
    values: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                values[name] = float(rest.split()[0]) / 1024
    if len(values) < 2:
        return None
    return values["MemTotal"] - values["MemAvailable"], values["MemTotal"]


SMI_TIMEOUT_S = 5.0
_GPU_FIELDS = ("utilization", "memory_used", "memory_total", "power", "power_limit")
_warned: set[str] = set()  # each kind of trouble with nvidia-smi is said once per worker, not every sample


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        LOG.warning("%s; GPU figures are left out of the host's load", message)


def _smi(arguments: list[str]) -> str | None:
    """`nvidia-smi ARGUMENTS`'s output; None without it, or when it fails or hangs. It runs in a process group
    of its own, killed whole at SMI_TIMEOUT_S: a hung driver call must leave nothing behind."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        process = subprocess.Popen(
            [smi, *arguments], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
        )
    except OSError as exc:
        _warn_once("start", f"nvidia-smi could not start ({exc})")
        return None
    try:
        out, _ = process.communicate(timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        _warn_once("hang", f"nvidia-smi did not answer within {SMI_TIMEOUT_S:g} s (its process group was killed)")
        return None
    return out if process.returncode == 0 else None


def _cell(text: str) -> float | None:
    """A number of nvidia-smi's CSV, None for its `[N/A]` and `[Not Supported]`; ValueError for anything else."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return None
    value = float(text)
    if not 0 <= value < 1e7:
        raise ValueError(text)
    return value


_gpu_count: int | None = None


def _gpus_expected() -> int:
    """How many GPUs a sample may hold: the lease's (`CUDA_VISIBLE_DEVICES`) where it lists indices, never
    more than `nvidia-smi -L` lists (asked once)."""
    global _gpu_count
    if _gpu_count is None:
        listed = _smi(["-L"]) or ""
        _gpu_count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and all(part.strip().isdigit() for part in visible.split(",")):
        return min(len(visible.split(",")), _gpu_count)
    return _gpu_count


def _gpus() -> list[dict[str, float | None]]:
    """Per visible GPU: utilisation %, memory used and total MB, power W and its limit; [] without nvidia-smi.
    Output that is not the CSV asked for (a row too few or too many cells, a cell not a number, more rows than
    GPUs) is dropped whole, with one warning."""
    command = [f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and all(part.strip().isdigit() for part in visible.split(",")):
        command.append(f"--id={visible}")
    out = _smi(command)
    if out is None:
        return []
    rows = [line for line in out.strip().splitlines() if line.strip()]
    expected = _gpus_expected()
    try:
        if len(rows) > expected:
            raise ValueError(f"{len(rows)} rows for {expected} GPUs")
        gpus = []
        for line in rows:
            cells = line.split(",")
            if len(cells) != len(_GPU_FIELDS):
                raise ValueError(f"{len(cells)} cells")
            gpus.append(dict(zip(_GPU_FIELDS, (_cell(c) for c in cells), strict=True)))
    except ValueError as exc:
        _warn_once("garbage", f"nvidia-smi's answer did not parse ({str(exc)[:80]})")
        return []
    return gpus


Counters = tuple[int, int, float]  # the host's busy and total clock ticks, this process's CPU seconds


def sample(previous: Counters | None) -> tuple[dict[str, float], Counters | None]:
    """One sample's metrics (MLflow's names, see the module) and the CPU counters the next sample's rates are
    taken against."""
    metrics: dict[str, float] = {}
    ticks = _cpu_ticks()
    mine = sum(os.times()[:2])  # this process, every thread: user + system seconds
    counters = (ticks[0], ticks[1], mine) if ticks is not None else None
    if counters is not None and previous is not None and counters[1] > previous[1]:
        total = counters[1] - previous[1]
        busy = counters[0] - previous[0]
        metrics["system/cpu_utilization_percentage"] = 100 * busy / total
        own = (mine - previous[2]) * os.sysconf("SC_CLK_TCK")  # this process's share, in ticks
        metrics["system/other_processes_cpu_percentage"] = max(0.0, 100 * (busy - own) / total)
    with contextlib.suppress(OSError):
        metrics["system/load_average"] = os.getloadavg()[0]
    memory = _memory_mb()
    if memory is not None:
        metrics["system/system_memory_usage_megabytes"] = memory[0]
        metrics["system/system_memory_usage_percentage"] = 100 * memory[0] / memory[1]
    for index, gpu in enumerate(_gpus()):
        prefix = f"system/gpu_{index}_"
        if gpu.get("utilization") is not None:
            metrics[prefix + "utilization_percentage"] = gpu["utilization"]
        if gpu.get("memory_used") is not None:
            metrics[prefix + "memory_usage_megabytes"] = gpu["memory_used"]
            if gpu.get("memory_total"):
                metrics[prefix + "memory_usage_percentage"] = 100 * gpu["memory_used"] / gpu["memory_total"]
        if gpu.get("power") is not None:
            metrics[prefix + "power_usage_watts"] = gpu["power"]
            if gpu.get("power_limit"):
                metrics[prefix + "power_usage_percentage"] = 100 * gpu["power"] / gpu["power_limit"]
    return metrics, counters


@dataclass(frozen=True)
class LoadSummary:
    """The host's load over a window of the run (the decode experiment's: its decodes), for its page."""

    samples: int
    cpus: int
    load_average_mean: float | None
    load_average_max: float | None
    cpu_percentage_mean: float | None
    other_processes_cpu_percentage_mean: float | None
    other_processes_cpu_percentage_max: float | None
    memory_used_mb_max: float | None
    gpu_utilization_percentage_mean: float | None

    @property
    def busy(self) -> bool:
        share = self.other_processes_cpu_percentage_mean
        return share is not None and share > BUSY_SHARE

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "busy": self.busy, "busy_share": BUSY_SHARE}


@dataclass
class HostSampler:
    """A thread that samples the host every `every_s` seconds into `log` (step: the sample's number) and keeps
    the samples for `summary`."""

    log: EventLog
    every_s: float = EVERY_S
    kept: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-load", daemon=True)

    def _loop(self) -> None:
        counters = None
        step = 0
        while True:
            try:
                metrics, counters = sample(counters)
                if metrics:
                    self.kept.append((time.time(), metrics))
                    self.log.emit("metrics", metrics, step=step)
                    step += 1
            except Exception:  # noqa: BLE001 - a sample that fails (an odd /proc, a closed log) is skipped, not fatal
                counters = None
            if self._stop.wait(self.every_s):
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self, since: float = 0.0) -> LoadSummary:
        """The samples taken since `since` (a time.time()); figures are None where no sample had them."""
        window = [m for t, m in list(self.kept) if t >= since]

        def values(key: str) -> list[float]:
            return [m[key] for m in window if key in m]

        def mean(key: str) -> float | None:
            found = values(key)
            return statistics.fmean(found) if found else None

        def most(key: str) -> float | None:
            found = values(key)
            return max(found) if found else None

        return LoadSummary(
            samples=len(window),
            cpus=os.cpu_count() or 1,
            load_average_mean=mean("system/load_average"),
            load_average_max=most("system/load_average"),
            cpu_percentage_mean=mean("system/cpu_utilization_percentage"),
            other_processes_cpu_percentage_mean=mean("system/other_processes_cpu_percentage"),
            other_processes_cpu_percentage_max=most("system/other_processes_cpu_percentage"),
            memory_used_mb_max=most("system/system_memory_usage_megabytes"),
            gpu_utilization_percentage_mean=mean("system/gpu_0_utilization_percentage"),
        )


_running: HostSampler | None = None


def running() -> HostSampler | None:
    """The sampler of this worker process, while `sampling` runs (None in a test that calls an experiment)."""
    return _running


@contextlib.contextmanager
def sampling(log: EventLog, every_s: float = EVERY_S) -> Iterator[HostSampler]:
    """Sample the host into `log` for the duration of the block."""
    global _running
    sampler = HostSampler(log, every_s)
    sampler.start()
    _running = sampler
    try:
        yield sampler
    finally:
        _running = None
        sampler.stop()
