"""A pool of hosts (`sweep.hosts`): each job takes the least loaded host with a free GPU lease, or waits for the
first one freed anywhere; the host-side look at the leases (and its claims); and a real sweep over two SSH hosts
whose timeline, read back from the lease files, shows no host idle while a job waited."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from orchestrator import PROJECT_ROOT
from orchestrator.config.validation import ConfigError
from orchestrator.host.launch import start_worker, write_spec
from orchestrator.host.leases import Leases, ProbeFailed, parse_probe, probe_leases
from orchestrator.host.local import LocalTransport
from orchestrator.host.run_folder import EXIT_CODE_FILE, LEASE_FILE
from orchestrator.sweep.host_pool import POLL_S, HostUnreachable, Turns, choose_host, waiting_line
from tests.conftest import MlflowServer, run_orchestrator
from tests.sshd import SSHServer
from tests.test_launch import assert_never_shared, code_dir, fake_python, wait_until

transport = LocalTransport()


# -- the choice, with a fake look at each host ------------------------------------------------------------------


def free(*gpus: int, busy: int = 0, reserved: int = 0) -> Leases:
    return Leases(gpus=tuple(range(len(gpus) + busy + reserved)), busy=busy, reserved=reserved, free=gpus)


def full(busy: int = 1, reserved: int = 0) -> Leases:
    return Leases(gpus=tuple(range(busy + reserved)), busy=busy, reserved=reserved)


class FakePool:
    """Each host's leases as a function of how many times the job has slept; claims recorded."""

    def __init__(self, states, claim_fails: set[int] = frozenset()) -> None:
        self.states = states  # host index -> callable(polls) -> Leases, or an exception to raise
        self.claim_fails = set(claim_fails)
        self.polls = 0
        self.claims: list[int] = []
        self.lines: list[str] = []

    def probe(self, index: int, claim: bool) -> Leases | None:
        state = self.states[index]
        if isinstance(state, Exception):
            raise state
        leases = state(self.polls)
        if not claim:
            return leases
        self.claims.append(index)
        if index in self.claim_fails or not leases.available:
            return Leases(leases.gpus, leases.busy, leases.reserved, leases.free, claimed=None)
        return Leases(leases.gpus, leases.busy, leases.reserved, leases.free, claimed=leases.free[0])

    def sleep(self, _seconds: float) -> None:
        self.polls += 1

    def choose(self, names=("a", "b", "c"), **kwargs):
        return choose_host(list(names)[: len(self.states)], self.probe, self.lines.append, sleep=self.sleep, **kwargs)


def test_the_least_loaded_host_with_a_free_gpu_is_claimed_ties_in_pool_order() -> None:
    pool = FakePool({0: lambda _: free(1, busy=2), 1: lambda _: free(0, 1), 2: lambda _: free(0, busy=1, reserved=1)})
    assert pool.choose()[0] == 1 and pool.claims == [1]
    # A less loaded host without a free GPU (its one GPU claimed by a job about to start) is passed over.
    pool = FakePool({0: lambda _: free(2, busy=2), 1: lambda _: full(busy=0, reserved=1), 2: lambda _: free(3, busy=3)})
    index, leases = pool.choose()
    assert (index, leases.claimed) == (0, 2) and pool.claims == [0]
    pool = FakePool({0: lambda _: free(1, busy=1), 1: lambda _: free(1, busy=1)})  # a tie: the pool's order
    assert pool.choose()[0] == 0
    assert pool.lines == [] and pool.polls == 0, "a free GPU is taken at once, without a word"


def test_a_claim_another_job_beat_this_one_to_passes_to_the_next_host() -> None:
    pool = FakePool({0: lambda _: free(0), 1: lambda _: free(0, busy=1)}, claim_fails={0})
    index, leases = pool.choose()
    assert (index, leases.claimed, pool.claims) == (1, 0, [0, 1])


def test_with_every_gpu_leased_the_job_waits_says_so_once_and_takes_the_first_freed() -> None:
    pool = FakePool({0: lambda polls: full(busy=2), 1: lambda polls: full(busy=1) if polls < 5 else free(0)})
    index, leases = pool.choose()
    assert (index, leases.claimed) == (1, 0)
    assert pool.polls == 5, "looked again after each pause until a lease was free"
    assert pool.lines == ["every GPU of the pool (a, b) is leased; waiting for one to be free"], "one line per wait"
    assert pool.lines[0] == waiting_line(["a", "b"])


def test_a_host_that_cannot_be_reached_is_left_out_with_one_line() -> None:
    down = HostUnreachable("a: cannot reach 10.0.0.9:22 (timed out); check host.hostname and host.port")
    pool = FakePool({0: down, 1: lambda _: free(0)})
    assert pool.choose()[0] == 1
    assert pool.lines == [f"{down}; left out of the pool for this job"]
    # Waiting, a pool that has lost a host names the ones left.
    pool = FakePool({0: down, 1: lambda polls: full() if polls < 1 else free(0)})
    assert pool.choose()[0] == 1
    assert pool.lines[1] == "every GPU of the pool (b) is leased; waiting for one to be free"


def test_a_pool_none_of_whose_hosts_can_be_reached_is_one_error_naming_each() -> None:
    pool = FakePool({0: HostUnreachable("a: cannot reach a:22"), 1: HostUnreachable("b: refused bob")})
    with pytest.raises(ConfigError) as error:
        pool.choose()
    assert (
        str(error.value) == "sweep.hosts: no host of the pool could be reached (a: cannot reach a:22; b: refused bob)"
    )


def test_a_sweep_cancelled_while_the_job_waits_ends_the_wait_without_a_claim() -> None:
    pool = FakePool({0: lambda _: full(), 1: lambda _: full()})
    assert pool.choose(stopped=lambda: pool.polls >= 2) is None
    assert pool.claims == [] and len(pool.lines) == 1


def test_a_free_gpu_is_left_to_the_jobs_ahead_until_they_have_chosen() -> None:
    pool = FakePool({0: lambda _: free(0), 1: lambda _: free(0)})
    index, _ = pool.choose(my_turn=lambda: pool.polls >= 3)
    assert index == 0 and pool.claims == [0] and pool.polls == 3
    assert pool.lines == [], "waiting for an earlier job to choose is not waiting for a GPU"


def test_turns_follow_the_grid_order(tmp_path: Path) -> None:
    first, second = Turns(tmp_path, 0), Turns(tmp_path, 1, arrival_grace_s=0.3)
    assert first.my_turn(), "the first job has nobody ahead"
    assert not second.my_turn(), "job 0 has not come yet: it is waited for"
    first.enter()
    assert not second.my_turn()
    first.leave()
    assert second.my_turn()
    third = Turns(tmp_path, 3, arrival_grace_s=0.3)  # job 2 never comes: waited for a while, then passed over
    assert not third.my_turn()
    assert wait_until(third.my_turn, timeout=2)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "3").write_text(f"waiting {socket.gethostname()} {gone.stdout.strip()}\n")
    assert Turns(tmp_path, 4, arrival_grace_s=0).my_turn(), "a job whose process died holds nobody up"
    other_pool = Turns(tmp_path, 4, pool=["c"])
    other_pool.enter()  # alive, waiting: holds up the jobs of its own pool only
    assert not Turns(tmp_path, 5, pool=["c"], arrival_grace_s=0).my_turn()
    assert Turns(tmp_path, 5, pool=["a", "b"], arrival_grace_s=0).my_turn()


# -- the host side: the script that looks at the leases and claims one --------------------------------------------


def look(
    locks: Path, gpus: str | list[int] = (0, 1), claim: bool = False, claim_s: float = 90, workdir: Path | None = None
):
    gpus = gpus if isinstance(gpus, str) else list(gpus)
    return probe_leases(transport, gpus, str(locks), str(workdir or locks.parent / "work"), claim_s, claim)


@pytest.fixture
def held(tmp_path: Path) -> Iterator:
    """Hold a GPU's lease as a supervisor does (a flock on its lock file)."""
    files = []

    def hold(locks: Path, gpu: int) -> None:
        locks.mkdir(parents=True, exist_ok=True)
        f = (locks / f"gpu{gpu}.lock").open("a")
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        files.append(f)

    yield hold
    for f in files:
        f.close()


def test_a_claim_reserves_a_free_gpu_until_it_lapses(tmp_path: Path, held) -> None:
    locks = tmp_path / "locks"
    assert look(locks) == Leases(gpus=(0, 1), free=(0, 1)), "a first look creates what it needs"
    held(locks, 0)
    assert look(locks) == Leases(gpus=(0, 1), busy=1, free=(1,))
    claimed_at = time.monotonic()
    claimed = look(locks, claim=True, claim_s=4)  # long enough for the two looks below on a busy machine
    assert claimed.claimed == 1
    after = look(locks)
    assert (after.busy, after.reserved, after.free, after.load, after.available) == (1, 1, (), 2, False)
    assert look(locks, claim=True).claimed is None, "a reserved GPU is not claimed twice"
    time.sleep(max(0.0, claimed_at + 4.1 - time.monotonic()))  # the claim lapses (a job that never launched)
    assert look(locks).free == (1,)
    assert oct((locks).stat().st_mode & 0o7777) == "0o1777", "one lock folder for every user of the host"


def test_the_supervisor_that_leases_a_gpu_ends_the_claim_on_it(tmp_path: Path) -> None:
    locks, run_dir = tmp_path / "locks", tmp_path / "run"
    assert look(locks, gpus=[0], claim=True).claimed == 0
    python = fake_python(tmp_path, "sleep 1")
    write_spec(transport, str(run_dir), {})
    start_worker(transport, str(run_dir), python, code_dir(tmp_path), {}, gpus=[0], locks_dir=str(locks))
    assert wait_until(lambda: (run_dir / LEASE_FILE).exists())
    leased = look(locks, gpus=[0])
    assert (leased.busy, leased.reserved) == (1, 0)
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    assert look(locks, gpus=[0]).free == (0,), "the claim was taken by the lease: nothing is left reserved"


def test_a_host_without_gpus_to_lease_counts_its_live_workers_and_claims(tmp_path: Path) -> None:
    locks, work = tmp_path / "locks", tmp_path / "work"
    for name, pgid, ended in (("alive", os.getpgrp(), False), ("ended", os.getpgrp(), True), ("dead", 999999, False)):
        (work / "runs" / name).mkdir(parents=True)
        (work / "runs" / name / "pid").write_text(f"{pgid}\n")
        if ended:
            (work / "runs" / name / "exit_code").write_text("0\n")
    leases = look(locks, gpus="none", workdir=work)
    assert (leases.gpus, leases.running, leases.load, leases.available) == ((), 1, 1, True)
    assert look(locks, gpus="none", workdir=work, claim=True).claimed == "host"
    assert look(locks, gpus="none", workdir=work).load == 2
    # `auto` on a machine without nvidia-smi: no GPU to lease (as the preflight sees none).
    if not any(Path(p, "nvidia-smi").exists() for p in os.environ.get("PATH", "").split(os.pathsep)):
        assert look(locks, gpus="auto", workdir=work).gpus == ()


def test_auto_leases_every_gpu_nvidia_smi_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    listing = (
        "GPU 0: NVIDIA H200 (UUID: GPU-1111)\n"
        "  MIG 1g.18gb     Device  0: (UUID: MIG-2222)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-3333)\n"
    )
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n[ \"$1\" = -L ] && printf '%s' '{listing}'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    claimed = look(tmp_path / "locks", gpus="auto", claim=True)
    assert (claimed.gpus, claimed.claimed) == ((0, 1), 0)


def test_a_host_whose_leases_cannot_be_read_says_why(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ProbeFailed, match="cannot read its GPU leases: cannot read"):
        look(blocker / "locks")  # the lock folder cannot be made under a file
    with pytest.raises(ProbeFailed) as error:
        parse_probe(4, "gpus 0\nerror /x/pool.lock stayed locked\n")
    assert error.value.transient


# -- end to end: two SSH hosts, jobs of unequal length -------------------------------------------------------------


def optimal_makespan(durations: list[float], hosts: int = 2) -> float:
    """The best packing of the measured durations on `hosts` hosts (brute force)."""
    best = float("inf")
    for assignment in itertools.product(range(hosts), repeat=len(durations)):
        loads = [0.0] * hosts
        for duration, host in zip(durations, assignment, strict=True):
            loads[host] += duration
        best = min(best, max(loads))
    return best


def pool_host(conf: Path, name: str, server: SSHServer, root: Path) -> dict:
    """A host file for `server` in `conf/host/`: one GPU slot ([0], a lock file: no GPU needed), its own work
    and lock folders, as two machines would have."""
    host = {
        **yaml.safe_load((PROJECT_ROOT / "conf" / "host" / "localhost_ssh.yaml").read_text()),
        "name": name,
        "hostname": server.address,
        "port": server.port,
        "user": server.user,
        "identity_file": str(server.client_key),
        "known_hosts": str(server.known_hosts),
        "python": sys.executable,
        "workdir": str(root / name / "work"),
        "gpu_lock_dir": str(root / name / "locks"),
        "gpus": [0],
        "env": {"OMP_NUM_THREADS": "1"},  # an SSH session has none of this environment: two workers share two cores
    }
    (conf / "host" / f"{name}.yaml").write_text(yaml.safe_dump(host))
    return host


@contextlib.contextmanager
def timing_looks(server: SSHServer, scratch: Path) -> Iterator[list[float]]:
    """How long a look at a host's leases takes over SSH meanwhile (the same command, in folders of its own so
    that it touches no lock of the sweep's), every half second."""
    from orchestrator.host.ssh import SSHTransport

    times: list[float] = []
    stop = threading.Event()

    def loop() -> None:
        ssh = SSHTransport(server.host_config(scratch / "work"))
        ssh.open()
        try:
            while not stop.wait(0.5):
                begun = time.monotonic()
                probe_leases(ssh, "none", str(scratch / "locks"), str(scratch / "work"), 1, False)
                times.append(time.monotonic() - begun)
        finally:
            ssh.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield times
    finally:
        stop.set()
        thread.join(timeout=30)
    assert times, "looks were timed"


LONG, SHORT = 1000, 50  # decode.max_new_tokens: leases of about 25 s and 10 s here (worker start included)
WAITING = re.compile(
    r"sweep job #(\d+): every GPU of the pool \(pool_a, pool_b\) is leased; waiting for one to be free"
)


@pytest.mark.slow
def test_jobs_of_unequal_length_keep_every_host_busy(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """Two SSH hosts of one GPU slot each, four jobs at once (long, short, long, short): each job takes the host
    whose lease is free, in grid order, so the short host takes the second long job instead of leaving it to
    queue behind the first (as job N on hosts[N % 2] did)."""
    from tests.sshd import sshd_available, start_sshd, stop_sshd

    if (reason := sshd_available()) is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the SSH tests: {reason}")
        pytest.skip(reason)
    (tmp_path / "conf" / "host").mkdir(parents=True)
    servers = []
    try:
        hosts = {}
        for name in ("pool_a", "pool_b"):
            servers.append(start_sshd(tmp_path / f"sshd_{name}"))
            hosts[name] = pool_host(tmp_path / "conf", name, servers[-1], tmp_path)
        args = [
            "--multirun",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=4",
            "sweep.hosts=[pool_a,pool_b]",
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
            "model=tiny_hybrid",
            "experiment.num_prompts=1",
            "decode.tree_budgets=[4]",
            "seed=0,1",
            f"decode.max_new_tokens={LONG},{SHORT}",  # the grid: long, short, long, short
            f"orchestrator.state_dir={tmp_path / 'state'}",
            "tracking=server",
            f"tracking.uri={mlflow_server.uri}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ]
        started = time.time()
        with timing_looks(servers[0], tmp_path / "scratch") as look_s:
            result = run_orchestrator(args, tmp_path, timeout=300)
        took = time.time() - started
    finally:
        for server in servers:
            stop_sshd(server)
    assert result.returncode == 0, result.stdout + result.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent_id = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["parent_run_id"]
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent_id}'")
    jobs = sorted(runs, key=lambda r: int(r.data.tags["sweep.job"]))
    assert [j.data.params["decode.max_new_tokens"] for j in jobs] == [str(LONG), str(SHORT)] * 2
    assert all(j.info.status == "FINISHED" for j in jobs)
    # The timeline: each job's lease from the file its supervisor wrote ("<gpu> <start> <end>"), and the moment
    # it claimed its host, from its marker in the sweep's queue (written as it leaves the choice).
    queue = tmp_path / "sweep" / f"host_pool-{parent_id}"
    leases, claims = {}, {}  # job number -> (host, start, end); job number -> claim time
    for job in jobs:
        number, host = int(job.data.tags["sweep.job"]), job.data.tags["host"]
        _, start, end = (Path(hosts[host]["workdir"]) / "runs" / job.info.run_id / LEASE_FILE).read_text().split()
        leases[number] = (host, float(start), float(end))
        claims[number] = (queue / str(number)).stat().st_mtime
    assert [leases[n][0] for n in range(4)] == ["pool_a", "pool_b", "pool_b", "pool_a"], leases
    for name in hosts:
        assert_never_shared([("0", s, e) for host, s, e in leases.values() if host == name])
    # A freed lease is seen at the next look (every POLL_S ±25 %), which takes a command on each host and then
    # the claim, three commands as long as the slowest look timed alongside the sweep. Then the job launches
    # (MLflow run, connect, preflight, sync, start): its own overhead, measured here from claim to lease.
    seen_within = 1.25 * POLL_S + 3 * max(look_s)
    launches = [leases[n][1] - claims[n] for n in range(4)]
    first = min(s for _, s, _ in leases.values())
    wall = max(e for _, _, e in leases.values()) - first
    durations = [e - s for _, s, e in leases.values()]
    best = optimal_makespan(durations)
    seen, idle = [], []  # lease end → the next claim there, while jobs waited; lease end → next lease start
    for name in hosts:
        mine = sorted((s, e, n) for n, (host, s, e) in leases.items() if host == name)
        for (_, end, _), (start, _, n) in itertools.pairwise(mine):
            seen.append(claims[n] - end)
            idle.append(start - end)
        last_end = mine[-1][1]
        if any(claim > last_end + seen_within for claim in claims.values()):
            seen.append(float("inf"))  # idle at its end while a job still waited to claim a host
    round_robin = max(durations[0] + durations[2], durations[1] + durations[3])  # job N on hosts[N % 2]
    figures = (
        f"wall {wall:.1f}s, best packing {best:.1f}s ({wall / best - 1:+.1%}; job N on hosts[N % 2]: "
        f"{round_robin:.1f}s), leases {', '.join(f'{d:.1f}' for d in durations)}s, freed lease claimed after "
        f"{', '.join(f'{d:.1f}' for d in seen)}s, launches {', '.join(f'{d:.1f}' for d in launches)}s, "
        f"idle between leases {', '.join(f'{d:.1f}' for d in idle)}s, a look {min(look_s):.2f}-{max(look_s):.2f}s "
        f"(seen within {seen_within:.1f}s), sweep {took:.0f}s"
    )
    print(figures)
    said = [int(n) for n in WAITING.findall(result.stdout)]
    assert sorted(said) == [2, 3], f"the two jobs that waited said so once each: {said}\n{result.stdout}"
    assert len(seen) == 2 and all(0 <= d <= seen_within for d in seen), figures  # no host idle while a job waited
    assert max(launches) < 30, figures  # launches, not a hang (they vary with the load: 5-15 s seen here)
    # Within 15 % of the best packing, plus the one hand-over each host makes here (seen, then launched); and
    # shorter than job N on hosts[N % 2] would have been with these very leases.
    assert wall <= 1.15 * best + seen_within + max(launches), figures
    assert wall < round_robin, figures


def test_a_host_of_the_pool_that_refuses_the_connection_is_named_with_the_setting_to_check(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from orchestrator.config.settings import HostConfig
    from orchestrator.sweep.host_pool import _Pool
    from tests.conftest import free_port

    host = HostConfig.from_mapping(
        {
            "name": "gone",
            "kind": "ssh",
            "hostname": "127.0.0.1",
            "user": "nobody",
            "port": free_port(),  # nothing listens there
            "identity_file": None,
            "proxy_jump": None,
            "known_hosts": str(tmp_path / "known_hosts"),
            "accept_new_host_key": False,
            "python": sys.executable,
            "workdir": str(tmp_path / "work"),
            "env": {},
            "gpus": [0],
            "gpu_lock_dir": str(tmp_path / "locks"),
            "connect_timeout_s": 5,
            "keepalive_s": 2,
            "keepalive_count_max": 3,
            "sync": "auto",
            "reconnect_budget_s": 0,
        }
    )
    config = SimpleNamespace(host=host, orchestrator=SimpleNamespace(start_timeout_s=60))
    pool = _Pool(["gone"], [], [config])
    lines: list[str] = []
    with pytest.raises(ConfigError) as error:
        choose_host(["gone"], pool.probe, lines.append)
    pool.close()
    assert re.fullmatch(
        r"gone: cannot reach 127\.0\.0\.1:\d+ \(.*\); check host\.hostname and host\.port", lines[0].split("; left")[0]
    ), lines
    assert str(error.value).startswith(
        "sweep.hosts: no host of the pool could be reached (gone: cannot reach 127.0.0.1:"
    )
