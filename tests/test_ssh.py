"""SSH hosts end to end over a real sshd on 127.0.0.1: sync, launch, streaming, host keys, literal arguments."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator import PROJECT_ROOT
from orchestrator.host.ssh import HostKeyRefused, SSHTransport
from orchestrator.host.sync import COMPLETE_MARK, sync_code
from orchestrator.host.transport import CONNECTION_ERRORS
from orchestrator.lifecycle.errors import HostLost
from orchestrator.lifecycle.follow import Reconnect
from tests.conftest import MlflowServer, free_port, group_alive, run_orchestrator, start_orchestrator
from tests.sshd import SSHServer
from tests.test_end_to_end import mlflow_metrics, worker_metrics_for

pytestmark = pytest.mark.slow


def ssh_args(server: SSHServer, mlflow_server: MlflowServer, workdir: Path, state: Path, *extra: str) -> list[str]:
    return [
        *server.host_overrides(),
        f"host.python={sys.executable}",
        f"host.workdir='{workdir}'",  # quoted for Hydra's override grammar
        f"orchestrator.state_dir={state}",
        "tracking=server",
        f"tracking.uri={mlflow_server.uri}",
        *extra,
    ]


def test_probe_over_ssh(sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """A probe over SSH, its settings full of shell syntax (a work folder and an env value that would run
    `touch` if any command were built by pasting): taken literally, the run lands whole, private on the host,
    and nothing ran. Its folder then removed from the host, `logs=` says where it looked and exits 1.
    (One launch for the three: the shell-syntax and no-folder tests were each a probe of their own.)"""
    marker = tmp_path / "pwned"
    workdir = tmp_path / f"remote; touch {marker}"
    extra = ("experiment=probe", f"+host.env.ODD='$(touch {marker})'")
    args = ssh_args(sshd, mlflow_server, workdir, tmp_path / "state", *extra)
    result = run_orchestrator(args, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not marker.exists()
    (run_dir,) = (workdir / "runs").iterdir()
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "spec.json").stat().st_mode) == 0o600
    (snapshot,) = [p for p in (workdir / "code").iterdir() if p.is_dir()]
    assert (snapshot / COMPLETE_MARK).exists() and (snapshot / "remote_worker" / "runner.py").exists()
    run = MlflowClient(tracking_uri=mlflow_server.uri).get_run(run_dir.name)
    assert run.info.status == "FINISHED"
    assert run.data.tags["host"] == "localhost_ssh"
    assert run.data.params["probe.model.class"] == "Qwen3_5ForCausalLM"
    assert run.data.metrics["probe.hybrid_cache.commit_logits_max_abs_diff"] < 1e-5

    shutil.rmtree(run_dir)
    for follow in ((), ("follow=true",)):
        logs = run_orchestrator([*args, f"logs={run_dir.name[:8]}", *follow], tmp_path)
        assert logs.returncode == 1, logs.stdout + logs.stderr
        assert logs.stderr.strip() == f"localhost_ssh: run {run_dir.name[:8]} has no folder at {run_dir}: no logs"
    assert not marker.exists()


def test_decode_sweep_over_ssh(sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """A local prompt file travels with the run: the host has only the copy in the run folder."""
    local = tmp_path / "my prompts.jsonl"
    local.write_text(json.dumps({"id": "mine-1", "messages": [{"role": "user", "content": "def add(a, b):"}]}) + "\n")
    extra = (
        "experiment=ddtree_gdn",
        f"experiment.prompts='{local}'",
        "decode.max_new_tokens=12",
        "decode.tree_budgets=[8]",
        "decode.node_costs=false",  # proven end to end in test_end_to_end
    )
    result = run_orchestrator(ssh_args(sshd, mlflow_server, tmp_path / "remote", tmp_path / "state", *extra), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = (tmp_path / "remote" / "runs").iterdir()
    assert (run_dir / "prompts.jsonl").read_text() == local.read_text()
    assert stat.S_IMODE((run_dir / "prompts.jsonl").stat().st_mode) == 0o600
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == ["mine-1"] and rows[0]["prompt"].startswith("def add(a, b):")
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(run_dir.name)
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_dir.name}'")
    assert {c.info.run_name for c in children} == {"ar", "dflash", "ddtree_tb8"}
    assert all(c.data.metrics["lossless"] == 1.0 for c in children)


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_unchanged_tree_copies_nothing_and_a_change_makes_a_new_snapshot(
    sshd: SSHServer, tmp_path: Path, method: str
) -> None:
    tree = tmp_path / "checkout"
    shutil.copytree(
        PROJECT_ROOT / "remote_worker", tree / "remote_worker", ignore=shutil.ignore_patterns("__pycache__")
    )
    transport = SSHTransport(sshd.host_config(tmp_path / "remote"))
    remote = str(tmp_path / "remote")
    try:
        first, copied = sync_code(transport, remote, root=tree, method=method)
        assert copied
        again, copied_again = sync_code(transport, remote, root=tree, method=method)
        assert (again, copied_again) == (first, False)
        before = (Path(first) / "remote_worker" / "runner.py").read_text()
        (tree / "remote_worker" / "runner.py").write_text(before + "\n# changed\n")
        changed, copied_changed = sync_code(transport, remote, root=tree, method=method)
        assert copied_changed and changed != first
        assert (Path(first) / "remote_worker" / "runner.py").read_text() == before, "a snapshot never changes"
        assert (Path(changed) / "remote_worker" / "runner.py").read_text().endswith("# changed\n")
        assert sorted(p.name for p in (tmp_path / "remote" / "code").iterdir()) == sorted(
            [Path(first).name, Path(changed).name]
        ), "no partial folder or archive is left behind"
        unchanged = Path("remote_worker") / "events.py"
        shared = (Path(first) / unchanged).stat().st_ino == (Path(changed) / unchanged).stat().st_ino
        assert shared == (method == "rsync"), "rsync hard-links unchanged files from the previous snapshot"
    finally:
        transport.close()


def test_unknown_host_key_is_refused_with_instructions(
    sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    workdir = tmp_path / "remote"
    args = ssh_args(sshd, mlflow_server, workdir, tmp_path / "state", "experiment=probe", f"host.known_hosts={empty}")
    result = run_orchestrator(args, tmp_path)
    assert result.returncode == 1
    assert "unknown host key" in result.stdout
    assert not workdir.exists(), "nothing may be created on a host whose key was not checked"
    runs = MlflowClient(tracking_uri=mlflow_server.uri).search_runs(
        [e.experiment_id for e in MlflowClient(tracking_uri=mlflow_server.uri).search_experiments()],
        "tags.failure_stage = 'connect'",
    )
    said = next(r.data.tags["error"] for r in runs if "unknown host key" in r.data.tags["error"])
    assert "Verify it before trusting it" in said and "a network path you trust" in said
    assert f"ssh-keyscan -p {sshd.port} {sshd.address} | ssh-keygen -lf -" in said
    assert "accept_new_host_key" not in said, "the refusal never advises trusting an unverified key"


def test_a_changed_host_key_stops_the_run_at_once_with_the_fix(
    sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    known = tmp_path / "known_hosts"
    other = "AAAAC3NzaC1lZDI1NTE5AAAAIDC5fU0VpbVl0nKuUl0E4Am8YUl0IYb3y1uM0x6s9F1w"  # not the server's key
    known.write_text(f"[127.0.0.1]:{sshd.port} ssh-ed25519 {other}\n")
    workdir = tmp_path / "remote"
    args = ssh_args(sshd, mlflow_server, workdir, tmp_path / "state", "experiment=probe", f"host.known_hosts={known}")
    result = run_orchestrator(args, tmp_path)
    assert result.returncode == 1
    assert "host key CHANGED" in result.stdout
    assert "reconnecting" not in result.stdout and "lost " not in result.stdout  # not read as a network drop
    assert not workdir.exists(), "nothing may be created on a host whose key does not match"
    # How fast it stops is timed in-process below: this command's own start-up (Hydra, MLflow) varies too
    # much with the machine's load for a wall-clock bound here.
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.failure_stage = 'connect'")
    (error,) = [r.data.tags["error"] for r in runs if "CHANGED" in r.data.tags["error"]]
    assert error.startswith(f"localhost_ssh: [127.0.0.1]:{sshd.port}: host key CHANGED (now ssh-ed25519 SHA256:")
    assert error.endswith(f"`ssh-keygen -f {known} -R '[127.0.0.1]:{sshd.port}'`, then connect again")
    assert "\n" not in error


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("host.user=nobody-here", "refused nobody-here"),
        ("host.port={free_port}", "cannot reach 127.0.0.1:{free_port} (Connection refused)"),
    ],
)
def test_connection_failures_are_one_clear_line_and_leave_nothing(
    sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path, override: str, message: str
) -> None:
    port = free_port()
    workdir = tmp_path / "remote"
    args = ssh_args(sshd, mlflow_server, workdir, tmp_path / "state", "experiment=probe", "host.connect_timeout_s=5")
    started = time.monotonic()
    result = run_orchestrator([*args, override.format(free_port=port)], tmp_path)
    assert time.monotonic() - started < 30
    assert result.returncode == 1
    assert message.format(free_port=port) in " ".join(result.stdout.split())
    assert not workdir.exists()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    (run,) = [
        r
        for r in client.search_runs(
            [e.experiment_id for e in client.search_experiments()], "tags.failure_stage = 'connect'"
        )
        if message.format(free_port=port) in r.data.tags["error"]
    ]
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("localhost_ssh: ") and "\n" not in run.data.tags["error"]


def test_accept_new_remembers_a_first_seen_key(sshd: SSHServer, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    transport = SSHTransport(sshd.host_config(tmp_path, known_hosts=str(known), accept_new_host_key=True))
    try:
        assert transport.run(["echo", "hello"]).stdout == "hello\n"
    finally:
        transport.close()
    assert sshd.host_public_key in known.read_text()
    strict = SSHTransport(sshd.host_config(tmp_path, known_hosts=str(known)))
    try:
        assert strict.run(["true"]).ok, "the remembered key is now known"
    finally:
        strict.close()


def test_a_changed_host_key_is_refused_even_with_accept_new(sshd: SSHServer, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    other = "AAAAC3NzaC1lZDI1NTE5AAAAIDC5fU0VpbVl0nKuUl0E4Am8YUl0IYb3y1uM0x6s9F1w"
    known.write_text(f"[127.0.0.1]:{sshd.port} ssh-ed25519 {other}\n")
    transport = SSHTransport(sshd.host_config(tmp_path, known_hosts=str(known), accept_new_host_key=True))
    with pytest.raises(Exception, match=r"(?i)host key"):
        transport.run(["true"])
    transport.close()


WRONG_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDC5fU0VpbVl0nKuUl0E4Am8YUl0IYb3y1uM0x6s9F1w"  # not the server's


def test_a_changed_key_names_the_entry_as_known_hosts_has_it_and_its_fix_works(
    sshd: SSHServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """host.hostname is an ~/.ssh/config alias whose HostName and Port the ssh config gives: the line names
    the entry known_hosts holds (`[127.0.0.1]:<port>`, not the alias), at once, and the `ssh-keygen -R`
    it prints, run as printed, removes that entry and no other."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(f"Host kpro5-alias\n  HostName {sshd.address}\n  Port {sshd.port}\n")
    monkeypatch.setenv("HOME", str(home))
    known = tmp_path / "known hosts"  # a space: the printed command must quote it
    unrelated = f"elsewhere.example {sshd.host_public_key}"
    known.write_text(f"[{sshd.address}]:{sshd.port} {WRONG_KEY}\n{unrelated}\n")
    transport = SSHTransport(sshd.host_config(tmp_path, hostname="kpro5-alias", port=None, known_hosts=str(known)))
    started = time.monotonic()
    with pytest.raises(HostKeyRefused) as refused:
        transport.open()
    assert time.monotonic() - started < 5, "one handshake, no retries"
    entry = f"[{sshd.address}]:{sshd.port}"
    fingerprint = subprocess.run(
        ["ssh-keygen", "-l", "-f", "-"], input=sshd.host_public_key, capture_output=True, text=True, check=True
    ).stdout.split()[1]
    assert str(refused.value) == (
        f"{entry}: host key CHANGED (now ssh-ed25519 {fingerprint}; reinstalled, or someone in the middle). "
        f"If the host's owner confirms it: `ssh-keygen -f '{known}' -R '{entry}'`, then connect again"
    )
    (fix,) = re.findall(r"`(ssh-keygen [^`]+)`", str(refused.value))
    subprocess.run(["sh", "-c", fix], capture_output=True, check=True)
    assert known.read_text().splitlines() == [unrelated]
    with pytest.raises(HostKeyRefused, match="unknown host key"):  # the stale entry is gone: ask for the real one
        transport.reconnect()
    transport.close()


def test_a_key_that_changes_while_a_run_streams_is_not_retried_as_a_network_drop(
    sshd: SSHServer, tmp_path: Path
) -> None:
    """The follow loop loses its session (sshd restarted, the host reinstalled) and the host now shows another
    key: the run is left for `attach` at once with the key line, not after host.reconnect_budget_s of
    reconnects as if the network were down."""
    known = tmp_path / "known_hosts"
    shutil.copyfile(sshd.known_hosts, known)
    transport = SSHTransport(sshd.host_config(tmp_path, known_hosts=str(known)))
    notes: list[str] = []
    reconnect = Reconnect(transport, budget_s=600, note=notes.append)
    try:
        assert transport.run(["true"]).ok
        known.write_text(f"[{sshd.address}]:{sshd.port} {WRONG_KEY}\n")  # as if the host's key had changed
        for pid in sshd.connection_pids():
            os.kill(pid, signal.SIGTERM)
        started = time.monotonic()
        with pytest.raises(HostLost) as lost:
            for _ in range(50):
                try:
                    transport.run(["true"])
                except CONNECTION_ERRORS as error:
                    reconnect.after(error)
                time.sleep(0.05)
        assert time.monotonic() - started < 10, "no backoff through the reconnect budget"
    finally:
        transport.close()
    assert str(lost.value).startswith(f"localhost_ssh: [{sshd.address}]:{sshd.port}: host key CHANGED (now ")
    assert str(lost.value).endswith(f"`ssh-keygen -f {known} -R '[{sshd.address}]:{sshd.port}'`, then connect again")
    assert len(notes) <= 1, notes  # at most the one `lost …; reconnecting` of the dropped session


def test_unknown_key_refusal_is_a_host_key_error(sshd: SSHServer, tmp_path: Path) -> None:
    transport = SSHTransport(sshd.host_config(tmp_path, known_hosts=str(tmp_path / "none")))
    with pytest.raises(HostKeyRefused):
        transport.run(["true"])
    transport.close()


def wait_for_offset(state_dir: Path, at_least: int, process, timeout: float = 180) -> str:
    """The run id once the orchestrator has applied events past `at_least` bytes of the log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        for path in (state_dir / "runs").glob("*.json") if (state_dir / "runs").exists() else []:
            state = json.loads(path.read_text())
            if state["offset"] > at_least:
                return state["run_id"]
        time.sleep(0.1)
    pytest.fail("the orchestrator never got that far")


def assert_exact_histories(client: MlflowClient, run_dir: Path) -> None:
    """MLflow holds exactly the metric values the worker wrote, in the job's run and every child run."""
    run = client.get_run(run_dir.name)
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_dir.name}'")
    assert children
    for child in children:
        scope = child.data.tags["orchestrator.scope"]
        assert mlflow_metrics(client, child.info.run_id) == worker_metrics_for(run_dir, scope), scope


# The random tiny model: it drafts badly, so the run makes many rounds (events) for the faults to cut into.
SWEEP = (
    "experiment=ddtree_gdn",
    "model=tiny_hybrid",
    "experiment.num_prompts=3",
    "decode.max_new_tokens=48",
    "decode.tree_budgets=[16]",
)


def test_killed_ssh_connections_are_survived(sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    state = tmp_path / "state"
    process = start_orchestrator(ssh_args(sshd, mlflow_server, tmp_path / "remote", state, *SWEEP), tmp_path)
    try:
        wait_for_offset(state, 2000, process)
        for _ in range(2):  # cut every connection twice, mid-stream
            for pid in sshd.connection_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(1.5)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0, stdout + stderr
    assert "reconnected" in stdout
    (run_dir,) = (tmp_path / "remote" / "runs").iterdir()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    assert client.get_run(run_dir.name).info.status == "FINISHED"
    assert_exact_histories(client, run_dir)


def test_attach_after_the_orchestrator_was_killed(sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ssh_args(sshd, mlflow_server, tmp_path / "remote", state, *SWEEP)
    process = start_orchestrator(args, tmp_path)
    try:
        run_id = wait_for_offset(state, 2000, process)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    attached = run_orchestrator([*args, f"attach={run_id}"], tmp_path)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert f"attached to {run_id}" in attached.stdout
    run_dir = tmp_path / "remote" / "runs" / run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    assert_exact_histories(client, run_dir)


def test_attach_to_an_unknown_run_is_one_clear_line(
    sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    args = ssh_args(sshd, mlflow_server, tmp_path / "remote", tmp_path / "state", "attach=" + "0" * 32)
    result = run_orchestrator(args, tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"attach: no MLflow run {'0' * 32} at this tracking URI"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "host.python=/no/such/python",
            "localhost_ssh: the interpreter /no/such/python does not exist there (host.python)",
        ),
        (
            "model.path=/no/such/model",
            "localhost_ssh: model.path /no/such/model is missing or has no config.json",
        ),
    ],
)
def test_preflight_names_the_missing_piece_and_leaves_nothing(
    sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path, override: str, message: str
) -> None:
    workdir = tmp_path / "remote"
    extra = ["experiment=probe", override] + (["model.source=pretrained"] if "model.path" in override else [])
    started = time.monotonic()
    result = run_orchestrator(ssh_args(sshd, mlflow_server, workdir, tmp_path / "state", *extra), tmp_path)
    assert result.returncode == 1
    assert time.monotonic() - started < 60
    assert message in " ".join(result.stdout.split())
    assert not workdir.exists(), "a failed preflight copies and starts nothing"
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.failure_stage = 'preflight'"
    )
    assert any(r.data.tags["error"] == message for r in runs)


def test_the_printed_commands_work_as_printed_from_slash_with_a_fresh_home(
    sshd: SSHServer, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """A run detached with `host.*` overrides is logged and cancelled by the very commands it printed, run
    from `/` in a shell with an empty HOME and no PYTHONPATH: the entry point is named by its full path and
    the printed line carries every setting (host.python, the connection, the work folder). A command whose
    work folder differs from the run's record is refused in one line and leaves the worker running."""
    workdir = tmp_path / "remote"
    args = ssh_args(sshd, mlflow_server, workdir, tmp_path / "state", "detach=true", "decode.max_new_tokens=400")
    launched = run_orchestrator(args, tmp_path)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    printed = next(line.strip() for line in launched.stdout.splitlines() if "attach=" in line)
    assert printed.startswith(str(Path(sys.executable).parent / "ddtree-orch") + " attach="), printed
    (run_dir,) = (workdir / "runs").iterdir()
    run_id = run_dir.name
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    pgid = int((run_dir / "pid").read_text())
    home = tmp_path / "fresh-home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HOME=str(home), COLUMNS="120")

    def as_printed(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(shlex.split(command), cwd="/", env=env, capture_output=True, text=True, timeout=240)

    other = tmp_path / "other"
    wrong = as_printed(
        printed.replace("attach=", "cancel=").replace(f"host.workdir={workdir}", f"host.workdir={other}")
    )
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert wrong.stderr.strip().splitlines() == [
        f"cancel: run {run_id[:8]} records host.workdir={workdir}; this command's is {other}. A tag is never "
        f"followed: give host.workdir={workdir} if that is where you launched it"
    ]
    assert group_alive(pgid) and client.get_run(run_id).info.status == "RUNNING"

    logs = as_printed(printed.replace("attach=", "logs="))
    assert logs.returncode == 0 and "loaded tiny_trained" in logs.stdout, logs.stdout + logs.stderr
    cancelled = as_printed(printed.replace("attach=", "cancel="))
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert f"cancelled {run_id}: its worker was stopped and the run ends KILLED" in cancelled.stdout
    assert not group_alive(pgid)
    assert client.get_run(run_id).info.status == "KILLED"
    assert not (run_dir / "worker.env").exists()
