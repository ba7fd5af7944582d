"""Shared fixtures: a real MLflow server on a free loopback port, and running the orchestrator as a user does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.mlflow_server import MlflowServer, start_mlflow_server, stop_mlflow_server

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# Under pytest-xdist (`make test` runs a test process per core) the cores are shared out, not oversubscribed: each test
# process, and every worker or orchestrator it starts, computes on its share (set before torch is imported).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def tracking(monkeypatch: pytest.MonkeyPatch):
    """The commands in-process against a fake tracking store (tests/fakes.py): no sweep, no git, and the command
    line's overrides as a run with a secret in its environment would have them."""
    from orchestrator.cli import context
    from orchestrator.tracking.gitinfo import GitInfo
    from tests.fakes import FakeTracking

    fake = FakeTracking()
    monkeypatch.setattr(context, "open_tracking", lambda _config: fake)
    monkeypatch.setattr(context, "current_sweep", lambda _fail_fast: None)
    monkeypatch.setattr(context, "task_overrides", lambda: ["+host.env.HF_TOKEN=hf_secret", "seed=0"])
    monkeypatch.setattr(context, "git_info", lambda: GitInfo("abc", False, ""))
    return fake


@pytest.fixture
def datasets_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """`datasets` writes its prepared copies of the paper's sets under a temporary folder, not the user's cache,
    and the sets are read afresh: nothing is remembered from one test to the next."""
    import datasets

    from orchestrator.config import paper_datasets

    folder = tmp_path_factory.mktemp("hf_datasets_cache")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
    paper_datasets._load.cache_clear()
    yield folder
    paper_datasets._load.cache_clear()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """`mlflow server` with an SQLite store and proxied artifacts, on 127.0.0.1 only; stopped after the session."""
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    yield server
    stop_mlflow_server(server)


@dataclass(frozen=True)
class JobPaths:
    workdir: Path
    state_dir: Path

    def overrides(self) -> list[str]:
        # The GPU lease locks too: a test's leases must not wait on another test's (xdist runs them at once).
        return [
            f"host.workdir={self.workdir}",
            f"orchestrator.state_dir={self.state_dir}",
            f"host.gpu_lock_dir={self.workdir / 'gpu-locks'}",
        ]

    def run_dirs(self) -> list[Path]:
        runs = self.workdir / "runs"
        return sorted(runs.iterdir()) if runs.exists() else []


@pytest.fixture
def job_paths(tmp_path: Path) -> JobPaths:
    return JobPaths(workdir=tmp_path / "work", state_dir=tmp_path / "state")


def start_orchestrator(args: Sequence[str], cwd: Path, own_group: bool = False) -> subprocess.Popen:
    """Start `python -m orchestrator ARGS` the way a user would, in `cwd` (where Hydra writes its outputs).

    `own_group`: in a process group of its own, like a terminal's foreground job, so a test can send
    Ctrl-C to the whole group (parallel launchers' worker processes included)."""
    pythonpath = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    env["HF_DATASETS_CACHE"] = str(cwd / "hf-datasets-cache")  # a paper set's prepared copy: the test's, not the user's
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={cwd / 'hydra'}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0 if own_group else None,
    )


def run_orchestrator(args: Sequence[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    process = start_orchestrator(args, cwd)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"orchestrator did not finish in {timeout}s\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """A real sshd on a free loopback port; skipped where none can run, never under CI=true."""
    from tests.sshd import sshd_available, start_sshd, stop_sshd

    reason = sshd_available()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the SSH tests: {reason}")
        pytest.skip(reason)
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    stop_sshd(server)


def _slurm_folder(config: pytest.Config) -> Path:
    """One folder for the whole test run: the controller's base temporary folder (each xdist worker's is in it)."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return (base.parent if hasattr(config, "workerinput") else base) / "slurm"


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest):
    """The test run's single-node Slurm cluster (started once, whichever test process asks first); skipped
    where none can run (no packages, not root), never under CI=true."""
    from tests.slurm import shared_cluster, slurm_available

    reason = slurm_available()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests: {reason}")
        pytest.skip(reason)
    return shared_cluster(_slurm_folder(request.config))


_MODULE_SECONDS: dict[str, float] = {}
_MODULE_TESTS: dict[str, set[str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's setup, call and teardown time, added to its module's (in the controlling process under xdist,
    which receives every test process's reports)."""
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    _MODULE_TESTS.setdefault(module, set()).add(report.nodeid)
    log = os.environ.get("TEST_DURATIONS_LOG")  # each phase's time as it ends: a run one watches
    if log:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"{report.duration:8.2f} {report.when:8} {report.outcome:7} {report.nodeid}\n")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Where the suite's time went, a line per test module, slowest first (beside `--durations`' slowest tests):
    whoever adds a slow test sees it in every `make test`."""
    if hasattr(config, "workerinput") or not _MODULE_SECONDS:
        return
    ranked = sorted(_MODULE_SECONDS.items(), key=lambda item: -item[1])
    terminalreporter.write_sep("=", f"time per test module ({sum(_MODULE_SECONDS.values()):.0f} s of test time in all)")
    for module, seconds in ranked:
        terminalreporter.write_line(f"{seconds:8.1f} s  {len(_MODULE_TESTS[module]):4d} tests  {module}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controlling process stops the Slurm cluster (by the pids it recorded) once every test is done."""
    if hasattr(session.config, "workerinput"):
        return
    from tests.slurm import stop_recorded_cluster

    stop_recorded_cluster(_slurm_folder(session.config))
