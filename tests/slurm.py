"""A real single-node Slurm cluster for the tests: munged, slurmctld and slurmd from Debian's packages.

Like `sshd.py`, everything is its own: a fresh munge key and socket, a generated `slurm.conf` with the
node on loopback and free ports, state and spool folders under the test's temporary folder, and every
daemon stopped by the pid it wrote. It needs root (slurmd starts jobs as their user); CI runs as root.

The cluster is shared by the whole test run: under pytest-xdist the first test process that asks starts
it (under a file lock) and writes `cluster.json`; the others read that file; the controlling process
stops it when the session ends (`stop_recorded_cluster`, called from conftest's `pytest_sessionfinish`).

What the configuration says, and why:
- `ProctrackType=proctrack/pgid`: Slurm knows a job's processes by their process group, not by cgroup (a
  container has none to give). The worker runs in a session of its own (`setsid`), so Slurm never signals
  it: only the job's own SIGTERM handling stops it, which is what the tests check (with `linuxproc`,
  which tracks by parentage, Slurm would also kill a worker still under the job's step).
- `SelectTypeParameters=CR_CPU`: CPUs are the consumable resource, so a job asking for every CPU keeps
  the next one pending (the Ctrl-C test needs a pending job).
- `KillWait=10`: between Slurm's SIGTERM and its SIGKILL, the time the job has to stop its worker.
- No accounting storage: `squeue` and `scontrol` answer everything the orchestrator asks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.config.handover import write_whole

DAEMONS = ("munged", "slurmctld", "slurmd")
CLUSTER_FILE = "cluster.json"
KILL_WAIT_S = 10


@dataclass(frozen=True)
class SlurmCluster:
    root: str
    conf: str  # slurm.conf; every client command needs SLURM_CONF pointing at it
    partition: str
    node: str
    cpus: int
    pids: dict[str, int]

    def env(self) -> dict[str, str]:
        """The environment a test (and the orchestrator it starts) uses to reach this cluster."""
        return {**os.environ, "SLURM_CONF": self.conf}

    def command(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def queue(self) -> dict[str, str]:
        """Every job Slurm still lists: id (`123` or `123_4`) → state (PENDING, RUNNING, COMPLETING, …)."""
        out = self.command("squeue", "-h", "-r", "-o", "%i %T")  # -r: every array task on its own line
        return dict(line.split(maxsplit=1) for line in out.splitlines() if line.strip())

    def job_field(self, job_id: str, name: str) -> str | None:
        """One field of `scontrol show job` (JobState, Restarts, NodeList, …); None for a job Slurm forgot."""
        out = self.command("scontrol", "-o", "show", "job", job_id, check=False)
        for word in out.split():
            key, _, value = word.partition("=")
            if key == name:
                return value
        return None


def slurm_available() -> str | None:
    """None when a cluster can be started here, else the reason it cannot."""
    missing = [name for name in (*DAEMONS, "sbatch", "squeue", "scancel", "scontrol") if shutil.which(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install munge slurmctld slurmd slurm-client)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (CI runs as root)"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _conf(root: Path, node: str, cpus: int, ports: list[int], partition: str) -> str:
    return "\n".join(
        [
            "ClusterName=ddtree-tests",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            f"KillWait={KILL_WAIT_S}",
            "MinJobAge=600",
            "InactiveLimit=0",
            "Waittime=0",
            "PlugStackConfig=/dev/null",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _read_pid(path: Path, deadline: float) -> int:
    while True:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().strip())
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} was never written")
        time.sleep(0.05)


def start_cluster(root: Path) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under `root`; return once the node takes jobs."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("munge", "state", "spool", "log"):
        (root / name).mkdir(exist_ok=True)
    os.chmod(root, 0o755)  # munged wants the folders above its socket searchable, its key folder private
    key_dir = root / "munge-key"
    key_dir.mkdir(mode=0o700, exist_ok=True)
    key = key_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    # The short host name, and given to slurmd by name: a machine whose name is a full domain name still
    # finds its node line.
    node, cpus, partition = socket.gethostname().split(".")[0], os.cpu_count() or 1, "tests"
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, node, cpus, _free_ports(2), partition))
    munge = root / "munge"
    pids: dict[str, int] = {}
    deadline = time.monotonic() + 30
    try:
        subprocess.run(
            ["munged", "--force", f"--socket={munge / 'munge.socket'}", f"--key-file={key}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}"],
            check=True, timeout=30,
        )  # fmt: skip
        pids["munged"] = _read_pid(munge / "munged.pid", deadline)
        env = {**os.environ, "SLURM_CONF": str(conf)}
        for daemon, extra in (("slurmctld", []), ("slurmd", ["-N", node])):
            subprocess.run([daemon, "-f", str(conf), *extra], env=env, check=True, timeout=30)
            pids[daemon] = _read_pid(root / f"{daemon}.pid", deadline)
        cluster = SlurmCluster(str(root), str(conf), partition, node, cpus, pids)
        while (cluster.command("sinfo", "-h", "-o", "%t", check=False).strip() or "down") not in ("idle", "mix"):
            if time.monotonic() > deadline:
                logs = "\n".join((root / "log" / f"{d}.log").read_text()[-1500:] for d in ("slurmctld", "slurmd"))
                raise RuntimeError(f"the Slurm node never became idle:\n{logs}")
            time.sleep(0.2)
        return cluster
    except BaseException:
        _stop(pids)
        raise


def _stop(pids: dict[str, int]) -> None:
    """SIGTERM each daemon by its pid (slurmd first, munged last), then SIGKILL what is left."""
    order = [name for name in ("slurmd", "slurmctld", "munged") if name in pids]
    for name in order:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[name], signal.SIGTERM)
    deadline = time.monotonic() + 15
    for name in order:
        while _alive(pids[name]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pids[name]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[name], signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie of ours (none: the daemons fork away) counts as gone
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return False
    return True


def shared_cluster(folder: Path) -> SlurmCluster:
    """The test run's cluster: started by the first test process that asks, read from `folder` by the rest."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "cluster.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = folder / CLUSTER_FILE
        if record.exists():
            cluster = SlurmCluster(**json.loads(record.read_text()))
            if all(_alive(pid) for pid in cluster.pids.values()):
                return cluster
            _stop(cluster.pids)
        cluster = start_cluster(folder / "cluster")
        write_whole(record, json.dumps(asdict(cluster)))  # a test process killed mid-write leaves none
        return cluster


def stop_recorded_cluster(folder: Path) -> None:
    """Stop the cluster `shared_cluster` started under `folder`, if it did (at the end of the test run)."""
    record = folder / CLUSTER_FILE
    if record.exists():
        cluster = SlurmCluster(**json.loads(record.read_text()))
        with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
            if jobs := cluster.queue():  # a test stopped half-way: its jobs go first, while slurmd can end them
                cluster.command("scancel", *jobs, check=False)
                deadline = time.monotonic() + KILL_WAIT_S + 20
                while cluster.queue() and time.monotonic() < deadline:
                    time.sleep(0.5)
        _stop(cluster.pids)
        record.unlink()
