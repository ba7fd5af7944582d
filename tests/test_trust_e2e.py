"""The trust boundary end to end: a real sshd, a real MLflow server without authentication, a real Slurm.

Forged tags (set through the plain MLflow API, as anyone who can reach the server can), planted links and a
decoy process, each against the command a user types: nothing the forgery names is contacted, signalled,
overwritten or uploaded, and what the run really holds lands whole. The same rules in-process, every tag
and hostile value over a fake host: tests/test_trust.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import MlflowServer, group_alive, run_orchestrator
from tests.sshd import SSHServer
from tests.test_end_to_end import mlflow_metrics, worker_metrics_for
from tests.test_ssh import ssh_args

pytestmark = pytest.mark.slow
SHORT = ("experiment=probe",)  # a run with metrics, quickly done
LONG = ("model=tiny_hybrid", "decode.tree_budgets=[8]", "decode.max_new_tokens=1000", "decode.repeats=20")
SECRET = "TOPSECRET-the-first-line-of-a-key"


def wait(what: str, predicate, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:g}s")
        time.sleep(0.2)
    return value


def detached(args: list[str], tmp_path: Path) -> tuple[str, Path, str]:
    """Launch with detach=true: the run id, its folder, and the attach line it printed."""
    launched = run_orchestrator([*args, "detach=true"], tmp_path)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    printed = next(line.strip() for line in launched.stdout.splitlines() if "attach=" in line)
    run_id = printed.split("attach=", 1)[1].split()[0]
    return run_id, next(p for p in Path(args_workdir(args)).joinpath("runs").iterdir() if p.name == run_id), printed


def args_workdir(args: list[str]) -> str:
    value = next(a for a in args if a.startswith("host.workdir="))
    return value.split("=", 1)[1].strip("'")


@contextlib.contextmanager
def forwarded(port: int) -> Iterator[int]:
    """A TCP forwarder on a new loopback port to `port`: the host, moved (its sshd now answers elsewhere)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop = threading.Event()

    def pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(("127.0.0.1", port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_forged_connection_and_cursor_tags_and_a_planted_link_over_ssh(
    sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """A probe detached over SSH, then forged: its `host.port` tag names a listener of the test, its
    stream cursor lies past the end of its log, its stderr.log is a link to a 0600 secret; and the host moved
    (its sshd is reached now through another port). `attach` with `host.port=<the new port>`: the listener
    is never contacted, the moved host is, the mismatch and the cursor are each one line, every metric the
    worker wrote lands exactly, and the secret is in no artifact or tag."""
    workdir = tmp_path / "remote"
    run_id, run_dir, _ = detached(ssh_args(sshd, mlflow_server, workdir, tmp_path / "state", *SHORT), tmp_path)
    wait("the worker's end", lambda: (run_dir / "exit_code").exists())
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    forged_port = listener.getsockname()[1]
    for tag, value in (("host.port", str(forged_port)), ("orchestrator.offset", "99999999"),
                       ("orchestrator.last_seq", "99999")):  # fmt: skip
        client.set_tag(run_id, tag, value)
    secret = tmp_path / "secret.key"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    (run_dir / "stderr.log").unlink()
    (run_dir / "stderr.log").symlink_to(secret)
    try:
        with forwarded(sshd.port) as moved:
            known_hosts = tmp_path / "known_hosts.moved"
            key = sshd.known_hosts.read_text().split(" ", 1)[1]
            known_hosts.write_text(sshd.known_hosts.read_text() + f"[127.0.0.1]:{moved} {key}")
            args = [a for a in ssh_args(sshd, mlflow_server, workdir, tmp_path / "elsewhere-state", *SHORT)
                    if not a.startswith(("host.port=", "host.known_hosts="))]  # fmt: skip
            attach = run_orchestrator(
                [*args, f"host.port={moved}", f"host.known_hosts={known_hosts}", f"attach={run_id}"], tmp_path
            )
        said = " ".join(attach.stdout.split())
        assert attach.returncode == 0, attach.stdout + attach.stderr
        assert f"was launched with host.port={forged_port}; connecting with host.port={moved}" in said
        assert "its stream cursor (offset 99999999, seq 99999) lies past the end of the event log" in said
        assert "stderr.log not logged" in said and "is a symbolic link; not followed" in said
        readable, _, _ = select.select([listener], [], [], 0)
        assert readable == [], "the forged port was contacted"
    finally:
        listener.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert mlflow_metrics(client, run_id) == worker_metrics_for(run_dir, None)
    downloaded = Path(client.download_artifacts(run_id, "", str(tmp_path / "artifacts")))
    assert "stderr.log" not in {p.name for p in downloaded.rglob("*")}
    assert not any(SECRET in p.read_text(errors="replace") for p in downloaded.rglob("*") if p.is_file())
    assert not any(SECRET in value for value in run.data.tags.values())


def test_a_decoy_pid_and_planted_marks_over_ssh_are_left_alone(
    sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """A long decode detached over SSH. Its pid file is made to name a decoy (`sleep 600`, this user's, leading
    its own group): the printed cancel refuses in one line and the decoy and the worker live on. The pid file
    restored, and `cancel_requested` and `cancelled` made links to a stand-in authorized_keys: the cancel stops
    the worker, ends the run KILLED, and the stand-in is untouched."""
    workdir = tmp_path / "remote"
    run_id, run_dir, printed = detached(ssh_args(sshd, mlflow_server, workdir, tmp_path / "state", *LONG), tmp_path)
    worker = wait("the worker's pid", lambda: (run_dir / "pid").is_file() and int((run_dir / "pid").read_text()))
    decoy = subprocess.Popen(["sleep", "600"], start_new_session=True)
    cancel = printed.replace("attach=", "cancel=")
    try:
        (run_dir / "pid").write_text(f"{decoy.pid}\n")
        refused = subprocess.run(shlex.split(cancel), cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert refused.stderr.strip().splitlines() == [
            f"localhost_ssh: run {run_id[:8]} is not proven yours: pid {decoy.pid} does not carry the run id "
            f"{run_id[:8]} on its command line; nothing was changed"
        ]
        assert decoy.poll() is None and group_alive(worker)
        (run_dir / "pid").write_text(f"{worker}\n")
        stand_in = tmp_path / "authorized_keys"
        stand_in.write_text("ssh-ed25519 AAAA the user's own key\n")
        for mark in ("cancel_requested", "cancelled"):
            (run_dir / mark).symlink_to(stand_in)
        done = subprocess.run(shlex.split(cancel), cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"cancelled {run_id}: its worker was stopped and the run ends KILLED" in " ".join(done.stdout.split())
        assert stand_in.read_text() == "ssh-ed25519 AAAA the user's own key\n"
        assert not group_alive(worker)
        assert MlflowClient(tracking_uri=mlflow_server.uri).get_run(run_id).info.status == "KILLED"
    finally:
        decoy.kill()
        decoy.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker, signal.SIGKILL)


def local_args(mlflow_server: MlflowServer, tmp_path: Path, *extra: str) -> list[str]:
    return [
        f"host.workdir={tmp_path / 'work'}",
        f"orchestrator.state_dir={tmp_path / 'state'}",
        f"host.gpu_lock_dir={tmp_path / 'locks'}",
        "tracking=server",
        f"tracking.uri={mlflow_server.uri}",
        *extra,
    ]


def test_last_is_this_shells_and_the_printed_lines_work_from_slash_with_a_fresh_home(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """Two long decodes detached on this machine, the second (newer) from another shell (a session of its own).
    The first comes back within a minute, RUNNING and tagged detached, its page's address last; `list` shows
    both running with their model and the host's progress. From this shell, `logs=last` picks this shell's run
    and says so; `cancel=last` from a third shell picks the other shell's run and asks first (here, with no
    terminal to ask on, it refuses and names `yes=true`). Then each run's printed lines, run as printed from `/`
    with an empty HOME and no PYTHONPATH, log and cancel it (this shell's by the id prefix `list` shows): each
    ends KILLED, cancelled by the user, after its worker's own end event; `list` then has no active run, and
    `list=all` shows them KILLED. (This holds what `test_commands.py`'s detach, list and cancel test proved with
    a third long decode.)"""
    args = local_args(mlflow_server, tmp_path, *LONG)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    started = time.monotonic()
    launched = run_orchestrator([*args, "detach=true"], tmp_path)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    try:  # from here, whatever fails, the workers this test started are stopped (below)
        mine_printed = next(line.strip() for line in launched.stdout.splitlines() if "attach=" in line)
        mine = mine_printed.split("attach=", 1)[1].split()[0]
        mine_dir = tmp_path / "work" / "runs" / mine
        run = client.get_run(mine)
        assert run.info.status == "RUNNING" and run.data.tags["orchestrator.detached"] == "true"
        page = f"#/experiments/{run.info.experiment_id}/runs/{mine}?workflowType=machine_learning"
        address = f"{mlflow_server.uri}/{page}"
        assert launched.stdout.splitlines()[-1] == address, launched.stdout  # as a followed run ends
        assert time.monotonic() - started < 60
        other = subprocess.run(
            [sys.executable, "-m", "orchestrator", *args, "detach=true", f"hydra.run.dir={tmp_path / 'other'}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=240, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        )  # fmt: skip
        assert other.returncode == 0, other.stdout + other.stderr
        theirs_printed = next(line.strip() for line in other.stdout.splitlines() if "attach=" in line)
        theirs = theirs_printed.split("attach=", 1)[1].split()[0]
        events = mine_dir / "events.jsonl"  # the worker's first progress event comes once its imports are done
        wait("a progress event", lambda: events.exists() and b'"progress"' in events.read_bytes())
        listed = run_orchestrator([*local_args(mlflow_server, tmp_path), "list=true"], tmp_path)
        assert listed.returncode == 0 and "running" in listed.stdout, listed.stdout + listed.stderr
        assert mine[:8] in listed.stdout and theirs[:8] in listed.stdout and "tiny_hybrid" in listed.stdout
        assert re.search(r" · \d+/\d+", " ".join(listed.stdout.split())), listed.stdout  # the host's last progress
        logs = run_orchestrator([*local_args(mlflow_server, tmp_path), "logs=last"], tmp_path)
        assert logs.returncode == 0, logs.stdout + logs.stderr
        first = logs.stderr.strip().splitlines()[0] if logs.stderr.strip() else logs.stdout.splitlines()[0]
        assert first.startswith(f"last: run {mine[:8]} ") and first.endswith("from this shell"), (
            logs.stdout + logs.stderr
        )
        third = subprocess.run(
            [sys.executable, "-m", "orchestrator", *local_args(mlflow_server, tmp_path), "cancel=last",
             f"hydra.run.dir={tmp_path / 'third'}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=240, start_new_session=True, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        )  # fmt: skip
        assert third.returncode == 2, third.stdout + third.stderr
        assert third.stderr.strip().splitlines()[-1] == (
            f"cancel: cancel=last picked run {theirs[:8]} from another shell: add yes=true to cancel it"
        )
        assert client.get_run(theirs).info.status == "RUNNING"

        home = tmp_path / "fresh-home"
        home.mkdir()
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        env.update(HOME=str(home), COLUMNS="120")
        for run_id, printed in ((mine, mine_printed), (theirs, theirs_printed)):
            for verb in ("logs", "cancel"):
                named = run_id[:8] if (run_id, verb) == (mine, "cancel") else run_id  # the prefix `list` shows
                line = printed.replace(f"attach={run_id}", f"{verb}={named}")
                done = subprocess.run(shlex.split(line), cwd="/", env=env, capture_output=True, text=True, timeout=240)
                assert done.returncode == 0, line + "\n" + done.stdout + done.stderr
                assert verb != "logs" or "loaded tiny_hybrid" in done.stdout, done.stdout
            run = client.get_run(run_id)
            assert run.info.status == "KILLED" and run.data.tags["error"] == "cancelled by the user"
            assert run.data.tags["worker.status"] == "KILLED", "the worker's own end event was applied before ending"
        assert not group_alive(int((mine_dir / "pid").read_text()))
        again = run_orchestrator([*local_args(mlflow_server, tmp_path), "list=true"], tmp_path)
        assert "no active runs" in again.stdout, again.stdout + again.stderr
        everything = run_orchestrator([*local_args(mlflow_server, tmp_path), "list=all"], tmp_path)
        assert mine[:8] in everything.stdout and "KILLED" in everything.stdout, everything.stdout
    finally:
        for run_dir in (tmp_path / "work" / "runs").iterdir():
            with contextlib.suppress(ProcessLookupError, ValueError, OSError):
                os.killpg(int((run_dir / "pid").read_text()), signal.SIGKILL)


def test_a_state_folder_others_can_write_stops_the_command_before_anything(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    result = run_orchestrator(local_args(mlflow_server, tmp_path, *SHORT), tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"local: orchestrator.state_dir {state}: {state} is writable by every user (mode 0777); only you may write the "
        f"folder that says which run is yours (`chmod 700 {state}`, or choose another with orchestrator.state_dir=...)"
    ]
    assert not (tmp_path / "work").exists()


def test_a_forged_slurm_job_id_leaves_the_decoy_job_running(
    slurm_cluster, mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose `slurm.job_id` tag names another job of the user (a decoy), or an option (`--user=x` would
    cancel every job): `cancel=` refuses in one line, scancels nothing, and the decoy runs on."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)
    decoy = slurm_cluster.command(
        "sbatch",
        "--parsable",
        f"--partition={slurm_cluster.partition}",
        f"--output={tmp_path / 'decoy.out'}",
        "--wrap",
        "sleep 600",
    ).strip()  # its output file in the test's folder, never the checkout
    try:
        wait("the decoy job", lambda: "RUNNING" in slurm_cluster.command("squeue", "-h", "-j", decoy, "-o", "%T"), 60)
        client = MlflowClient(tracking_uri=mlflow_server.uri)
        experiment = client.get_experiment_by_name("forged") or client.create_experiment("forged")
        experiment_id = experiment if isinstance(experiment, str) else experiment.experiment_id
        for job_id, why in ((decoy, f"Slurm job {decoy} does not carry run"), ("--user=x", "is not a Slurm job id")):
            run = client.create_run(experiment_id, tags={"host": "local", "host.workdir": str(tmp_path / "work"),
                                                         "slurm.job_id": job_id})  # fmt: skip
            done = run_orchestrator([*local_args(mlflow_server, tmp_path), f"cancel={run.info.run_id}"], tmp_path)
            assert done.returncode == 1, done.stdout + done.stderr
            (line,) = done.stderr.strip().splitlines()
            assert line.startswith("cancel: ") and why in line and line.endswith("; nothing was cancelled"), line
            assert client.get_run(run.info.run_id).info.status == "RUNNING"
        assert "RUNNING" in slurm_cluster.command("squeue", "-h", "-j", decoy, "-o", "%T")
    finally:
        slurm_cluster.command("scancel", decoy, check=False)
