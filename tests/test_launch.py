"""Detached launch on the local host: pid and exit code files, stopping a process group, literal arguments."""

from __future__ import annotations

import itertools
import os
import shlex
import signal
import stat
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from orchestrator.host.launch import start_worker, stop_worker, wait_for_start, write_spec
from orchestrator.host.local import LocalTransport
from orchestrator.host.run_folder import ENV_FILE, EXIT_CODE_FILE, LEASE_FILE, PID_FILE, SPEC_FILE, worker_status
from orchestrator.host.sync import remove_abandoned_parts
from orchestrator.host.transport import CommandFailed, CommandResult
from orchestrator.lifecycle.phases import own_phase_1
from remote_worker.decoding.two_phase import PHASE_1_FILE
from tests.conftest import group_alive

transport = LocalTransport()


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for the interpreter; it gets `-m remote_worker run spec.json` as arguments."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def code_dir(tmp_path: Path, name: str = "code") -> str:
    """A worker's code folder as the sync leaves it (the user's, writable by no one else): the supervisor holds it
    open and checks it before it starts the (fake) interpreter."""
    folder = tmp_path / name
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    return str(folder)


def new_run(tmp_path: Path, host: LocalTransport = transport, name: str = "run") -> Path:
    """A run folder in the real layout (`<work folder>/runs/<run id>/`) with a spec naming its run id: what
    `stop_worker` proves before it signals anything."""
    run_id = uuid.uuid5(uuid.NAMESPACE_URL, str(tmp_path / name)).hex
    run_dir = tmp_path / "work" / "runs" / run_id
    write_spec(host, str(run_dir), {"run_id": run_id})
    return run_dir


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_spec_and_run_dir_are_private(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r1"
    write_spec(transport, str(run_dir), {"run_id": "r1"})
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / SPEC_FILE).stat().st_mode) == 0o600


def test_exit_code_and_arguments_are_recorded(tmp_path: Path) -> None:
    run_dir = new_run(tmp_path)
    python = fake_python(tmp_path, 'echo "$@" > args; echo "$PYTHONPATH $EXTRA" > env; exit 3')
    start_worker(transport, str(run_dir), python, code_dir(tmp_path), {"EXTRA": "x y"})
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    status = worker_status(transport, str(run_dir))
    assert (status.state, status.exit_code) == ("exited", 3)
    assert (run_dir / "args").read_text() == "-m remote_worker run spec.json\n"
    assert (run_dir / "env").read_text() == "/dev/fd/8 x y\n"  # the code folder, held open
    assert status.describe() == "worker exited with code 3"


def test_shell_syntax_in_paths_and_env_is_taken_literally(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    run_dir = tmp_path / f"odd dir; touch {marker}; $(touch {marker}) `touch {marker}`"
    write_spec(transport, str(run_dir), {})
    python = fake_python(tmp_path, 'echo "$VALUE" > value')
    odd_code = code_dir(tmp_path, f"code; touch {marker.name}; $(touch {marker.name})")
    start_worker(transport, str(run_dir), python, odd_code, {"VALUE": f"'; touch {marker}; '"})
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    assert (run_dir / "value").read_text() == f"'; touch {marker}; '\n"
    assert not marker.exists()


def test_worker_survives_in_its_own_session_and_stop_kills_the_group(tmp_path: Path) -> None:
    run_dir = new_run(tmp_path)
    # Ignores SIGTERM, so only the SIGKILL after the grace period can end it; `sleep` is a child in its group.
    python = fake_python(tmp_path, "trap '' TERM; sleep 60 & wait; sleep 60")
    start_worker(transport, str(run_dir), python, code_dir(tmp_path), {})
    status = wait_for_start(transport, str(run_dir))
    assert status.state == "running" and status.pid is not None
    assert os.getpgid(status.pid) == status.pid == os.getsid(status.pid), "leader of its own session and group"
    started = time.monotonic()
    final = stop_worker(transport, str(run_dir), grace_s=1.0)
    assert time.monotonic() - started < 10
    assert not final.alive
    assert wait_until(lambda: not group_alive(status.pid), timeout=5)


def test_a_kill_that_was_itself_killed_is_no_answer_that_the_group_is_gone() -> None:
    """Slurm cancelling a step signals every process in it, the `kill -0` just forked included (exit -15): that
    is not the group gone. Only `kill -0`'s own failure (exit 1) is; past the deadline without one, not gone."""
    from orchestrator.host import launch

    class Answers:
        def __init__(self, codes: list[int]) -> None:
            self.codes = iter(codes)

        def run(self, argv: Sequence[str], check: bool = True) -> CommandResult:
            assert list(argv[:2]) == ["kill", "-0"]
            return CommandResult(next(self.codes), "", "")

    answers = Answers([-15, 143, 0, 0, 1])
    assert launch._wait_until_gone(answers, "-42", 10.0)  # type: ignore[arg-type]
    assert next(answers.codes, None) is None  # it asked until `kill -0` failed, not at the first killed `kill`
    assert not launch._wait_until_gone(Answers(itertools.repeat(-15)), "-42", 0.2)  # type: ignore[arg-type]


def test_a_group_killed_outright_is_reported_as_vanished(tmp_path: Path) -> None:
    run_dir = new_run(tmp_path)
    start_worker(transport, str(run_dir), fake_python(tmp_path, "sleep 60"), code_dir(tmp_path), {})
    status = wait_for_start(transport, str(run_dir))
    pgid = int((run_dir / PID_FILE).read_text())
    assert status.pid == pgid
    os.killpg(pgid, signal.SIGKILL)
    assert wait_until(lambda: not group_alive(pgid), timeout=5)
    gone = worker_status(transport, str(run_dir))
    assert gone.state == "vanished"
    assert "without writing an exit code" in gone.describe()


def assert_never_shared(intervals: list[tuple[str, float, float]]) -> None:
    """No two (gpu, start, end) intervals on one GPU overlap."""
    for (gpu_a, start_a, end_a), (gpu_b, start_b, end_b) in itertools.combinations(intervals, 2):
        if gpu_a == gpu_b:
            assert end_a <= start_b or end_b <= start_a, f"two jobs held GPU {gpu_a} at the same time"


def test_gpu_leases_are_never_shared_and_a_third_job_waits(tmp_path: Path) -> None:
    """Two GPU slots, three jobs at once: each job holds one slot for its whole life; the third waits."""
    python = fake_python(tmp_path, 'echo "$CUDA_VISIBLE_DEVICES $(date +%s.%N)" > used; sleep 1.5; date +%s.%N >> used')
    run_dirs = [new_run(tmp_path, name=f"run{i}") for i in range(3)]
    for run_dir in run_dirs:
        start_worker(
            transport, str(run_dir), python, code_dir(tmp_path), {}, gpus=[0, 1], locks_dir=str(tmp_path / "locks")
        )
    saw_waiting = wait_until(lambda: any(worker_status(transport, str(d)).state == "waiting" for d in run_dirs))
    assert all(wait_until(lambda d=d: (d / EXIT_CODE_FILE).exists(), timeout=30) for d in run_dirs)
    used, leased = [], []
    for run_dir in run_dirs:
        gpu, start, end = (run_dir / "used").read_text().split()
        lease_gpu, lease_start, lease_end = (run_dir / LEASE_FILE).read_text().split()
        assert gpu == lease_gpu
        assert float(lease_start) <= float(start) <= float(end) <= float(lease_end), "the worker ran inside its lease"
        used.append((gpu, float(start), float(end)))
        leased.append((gpu, float(lease_start), float(lease_end)))
    assert_never_shared(used)
    assert_never_shared(leased)
    assert {gpu for gpu, _, _ in used} == {"0", "1"}
    assert saw_waiting, "with both slots taken the third job reports that it waits"


def command_lines_holding(secret: str) -> list[str]:
    """Every process on this machine whose command line holds `secret`, as any user can read in `ps`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:  # gone, or not ours to read
                continue
            if secret.encode() in cmdline:
                words = cmdline.decode(errors="replace").split("\0")
                found.append(f"{entry.name}: {shlex.join(words)}")
    return found


def test_the_workers_environment_is_in_no_process_list_nor_left_on_disk(tmp_path: Path) -> None:
    secret = f"hf_{uuid.uuid4().hex}"
    run_dir = new_run(tmp_path)
    python = fake_python(tmp_path, 'echo "$HF_TOKEN|$OTHER" > seen; sleep 30')
    start_worker(transport, str(run_dir), python, code_dir(tmp_path), {"HF_TOKEN": secret, "OTHER": "a b"})
    try:
        assert wait_until(lambda: (run_dir / "seen").exists())
        assert (run_dir / "seen").read_text() == f"{secret}|a b\n", "the worker still sees its variables"
        assert not (run_dir / ENV_FILE).exists(), "read and deleted before the worker ran"
        assert command_lines_holding(python), "the scan sees the worker's own command line"
        assert command_lines_holding(secret) == []
    finally:
        stop_worker(transport, str(run_dir), grace_s=1.0)


class RecordingTransport(LocalTransport):
    """This machine, noting every command line and every file written, as they would travel over SSH."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: list[list[str]] = []
        self.files: dict[str, tuple[bytes, int]] = {}

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> CommandResult:
        assert env is None
        self.commands.append(list(argv))
        return super().run(argv, env=env, check=check)

    def write_file(self, path: str, data: bytes, mode: int, *, exclusive: bool = False) -> None:
        self.files[path] = (data, mode)
        super().write_file(path, data, mode, exclusive=exclusive)

    def create_file(self, path: str, data: bytes, mode: int) -> bool:
        self.files[path] = (data, mode)
        return super().create_file(path, data, mode)


def test_the_environment_travels_as_a_private_file_not_a_command_line(tmp_path: Path) -> None:
    recording = RecordingTransport()
    run_dir = new_run(tmp_path, recording)
    secret = f"pw'; echo {uuid.uuid4().hex}"
    start_worker(recording, str(run_dir), fake_python(tmp_path, "exit 0"), "/code dir", {"DB_PASSWORD": secret})
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    assert not any(secret in arg or "DB_PASSWORD" in arg for argv in recording.commands for arg in argv)
    data, mode = recording.files[str(run_dir / ENV_FILE)]
    assert mode == 0o600
    assert data.decode() == f"export DB_PASSWORD={shlex.quote(secret)}\nexport PYTHONPATH='/code dir'\n"
    assert not (run_dir / ENV_FILE).exists()


def test_a_name_that_is_not_a_variable_name_is_refused(tmp_path: Path) -> None:
    recording = RecordingTransport()
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        start_worker(recording, str(tmp_path), "python", "/code", {"A; touch x": "1"})
    assert recording.commands == [] and recording.files == {}


def test_a_worker_whose_environment_file_is_gone_does_not_run(tmp_path: Path) -> None:
    run_dir = new_run(tmp_path)

    class NoFile(LocalTransport):
        def create_file(self, path: str, data: bytes, mode: int) -> bool:
            return True  # said written, and gone before the supervisor looks

    start_worker(NoFile(), str(run_dir), fake_python(tmp_path, "touch ran"), "/code", {"HF_TOKEN": "x"})
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    assert worker_status(transport, str(run_dir)).exit_code == 1
    assert not (run_dir / "ran").exists()


@pytest.mark.slow
def test_over_ssh_the_environment_travels_by_sftp_and_stays_out_of_ps(sshd, tmp_path: Path) -> None:
    """Over SSH the command line reaches the host's process list (sshd runs it with `sh -c`); the file does not."""
    from orchestrator.host.ssh import SSHTransport

    secret = f"hf_{uuid.uuid4().hex}"
    ssh = SSHTransport(sshd.host_config(tmp_path / "remote"))
    ssh.open()
    try:
        run_dir = tmp_path / "remote" / "runs" / ("1f" * 16)
        write_spec(ssh, str(run_dir), {"run_id": "1f" * 16})
        python = fake_python(tmp_path, 'echo "$HF_TOKEN" > seen; sleep 30')
        start_worker(ssh, str(run_dir), python, code_dir(tmp_path), {"HF_TOKEN": secret})
        assert wait_until(lambda: (run_dir / "seen").exists())
        assert (run_dir / "seen").read_text() == f"{secret}\n"
        assert not (run_dir / ENV_FILE).exists()
        assert command_lines_holding(python)
        assert command_lines_holding(secret) == []
        stop_worker(ssh, str(run_dir), grace_s=1.0)
    finally:
        ssh.close()


def test_a_local_command_killed_by_the_terminals_ctrl_c_is_an_interruption_not_a_failure() -> None:
    """Ctrl-C reaches the orchestrator's whole process group: a status query it kills must end the run as
    interrupted (KILLED), not FAILED with a command error."""
    from orchestrator.host.local import LocalTransport
    from orchestrator.lifecycle.errors import Interrupted

    # A terminal's foreground job starts with SIGINT at its default; a test runner started in the background
    # (`make test &`, some CI harnesses) inherits it ignored, and so would the command (an ignored signal
    # stays ignored across exec): it would never die of the Ctrl-C. Give it the terminal's disposition.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(Interrupted):
            LocalTransport().run(["sh", "-c", "kill -INT $$; sleep 5"])
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_start_command_that_failed_is_told_from_one_still_starting(tmp_path: Path) -> None:
    """The status script on a real shell: no pid and nothing on stderr is `starting`; no pid and the start
    command's complaint on stderr (`setsid: not found`) is `unstarted`, which the launch fails on at once."""
    transport = LocalTransport("local")
    assert worker_status(transport, str(tmp_path)).state == "starting"
    (tmp_path / "stderr.log").write_text("sh: 1: setsid: not found\n")
    status = worker_status(transport, str(tmp_path))
    assert status.state == "unstarted" and not status.alive
    (tmp_path / "pid").write_text(f"{os.getpid()}\n")  # once the supervisor has its pid, stderr is the worker's
    assert worker_status(transport, str(tmp_path)).state != "unstarted"


def test_the_partial_upload_named_for_a_run_is_removed_and_no_other(tmp_path: Path) -> None:
    """The clean-up `attach` runs for a run killed mid-sync, on a real shell: its own part and archive go,
    another run's part (perhaps still copying) and the published snapshots stay."""
    code = tmp_path / "code"
    for name in ("abc.part-run1", "abc.part-run2", "abc"):
        (code / name).mkdir(parents=True)
        (code / name / "f.py").write_text("x")
    (code / "abc.part-run1.tar.gz").write_bytes(b"\x1f\x8b")
    assert remove_abandoned_parts(LocalTransport(), str(tmp_path), "run1")
    assert sorted(p.name for p in code.iterdir()) == ["abc", "abc.part-run2"]
    assert not remove_abandoned_parts(LocalTransport(), str(tmp_path), "run1")  # nothing left to remove
    with pytest.raises(ValueError):
        remove_abandoned_parts(LocalTransport(), str(tmp_path), "*")


class TermedOnce(LocalTransport):
    """A local host whose first `n` commands are killed by SIGTERM as they run, as Slurm's scancel kills every
    process of the job's step (a status read in flight included) at the moment it signals the orchestrator."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> CommandResult:
        if self.left > 0:
            self.left -= 1
            return super().run(["sh", "-c", 'kill -TERM "$$"'], env=env, check=check)  # a real shell, really killed
        return super().run(argv, env=env, check=check)


def test_a_status_read_killed_by_the_jobs_sigterm_is_asked_again(tmp_path: Path) -> None:
    """One read killed by the SIGTERM (Slurm's cancel): asked once more, the status is the run folder's; killed
    twice, it is a failed command, never a guess."""
    run_dir = new_run(tmp_path)
    (run_dir / EXIT_CODE_FILE).write_text("3\n")
    status = worker_status(TermedOnce(1), str(run_dir))
    assert (status.state, status.exit_code) == ("exited", 3)
    with pytest.raises(CommandFailed):
        worker_status(TermedOnce(2), str(run_dir))


def _snapshots(tmp_path: Path) -> tuple[Path, Path]:
    """The work folder's code folder with a snapshot the sync checked (`real`), and a planted copy beside it
    that an attacker who may write the work folder would swap in under the same name."""
    work = tmp_path / "work"
    for folder, text in ((work / "code" / "abc", "real"), (work / "code.planted" / "abc", "planted")):
        (folder / "remote_worker").mkdir(parents=True, mode=0o755)
        (folder / "remote_worker" / "__init__.py").write_text(text)
    return work, work / "code" / "abc"


@pytest.mark.parametrize("planted", ["group-writable", "foreign owner"])
def test_a_code_folder_swapped_before_the_worker_opens_it_is_refused(tmp_path: Path, planted: str) -> None:
    """The sync checked the snapshot by name; then the `code` folder is swapped for a planted copy (the hook: the
    test swaps it before the launch). The supervisor holds the folder it is given, checks what it holds, and
    starts nothing from a copy another user owns or could write."""
    work, snapshot = _snapshots(tmp_path)
    entry = work / "code.planted" / "abc" / "remote_worker" / "__init__.py"
    if planted == "foreign owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(entry, 65534, 65534)
    else:
        entry.chmod(0o664)
    os.rename(work / "code", work / "code.real")
    os.rename(work / "code.planted", work / "code")
    run_dir = new_run(tmp_path)
    start_worker(transport, str(run_dir), fake_python(tmp_path, 'cat "$PYTHONPATH/remote_worker/__init__.py" > read'),
                 str(snapshot), {})  # fmt: skip
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    assert worker_status(transport, str(run_dir)).exit_code == 126 and not (run_dir / "read").exists()
    assert (run_dir / "stderr.log").read_text() == (
        f"ddtree-worker: not run from {snapshot}: {snapshot}/remote_worker/__init__.py is a link, not yours, "
        "or writable by others\n"
    )


def test_a_code_folder_swapped_after_the_check_is_not_what_the_worker_reads(tmp_path: Path) -> None:
    """The swap made at the worst moment, by the (fake) interpreter itself just before it reads its code: it
    reads the folder the supervisor held and checked, through its descriptor, not the name (the real worker's
    imports go the same way: PYTHONPATH is /dev/fd/8)."""
    work, snapshot = _snapshots(tmp_path)
    swap_then_read = (
        'mv "$W/code" "$W/code.real" && mv "$W/code.planted" "$W/code" && '
        'cat "$PYTHONPATH/remote_worker/__init__.py" > read && echo "$PYTHONPATH" > path'
    )
    run_dir = new_run(tmp_path)
    start_worker(transport, str(run_dir), fake_python(tmp_path, swap_then_read), str(snapshot), {"W": str(work)})
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    assert worker_status(transport, str(run_dir)).exit_code == 0, (run_dir / "stderr.log").read_text()
    assert (work / "code" / "abc" / "remote_worker" / "__init__.py").read_text() == "planted", "the swap happened"
    assert (run_dir / "read").read_text() == "real" and (run_dir / "path").read_text() == "/dev/fd/8\n"


def test_a_requeued_attempt_takes_its_runs_own_phase_one_and_only_a_regular_file(tmp_path: Path) -> None:
    """`relaunch`: a two-phase worker Slurm stopped in phase 2 left phase 1 whole in its run folder; the attempt
    started again is handed those bytes, and the spec written with them names the file."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert own_phase_1(transport, str(run_dir)) is None  # stopped before phase 1 ended, or a grid run
    (tmp_path / "secret").write_bytes(b"private")
    (run_dir / PHASE_1_FILE).symlink_to(tmp_path / "secret")
    assert own_phase_1(transport, str(run_dir)) is None  # never read through a link
    (run_dir / PHASE_1_FILE).unlink()
    (run_dir / PHASE_1_FILE).write_bytes(b'{"format": 1}\n')
    handed = own_phase_1(transport, str(run_dir))
    assert handed == b'{"format": 1}\n'
    write_spec(transport, str(run_dir), {"experiment": {"phase_1_file": PHASE_1_FILE}}, files={PHASE_1_FILE: handed})
    assert (run_dir / PHASE_1_FILE).read_bytes() == handed and stat.S_IMODE(
        (run_dir / PHASE_1_FILE).stat().st_mode
    ) == 0o600


def test_the_supervisors_files_are_private_under_a_shared_umask_and_the_worker_keeps_the_hosts(tmp_path: Path) -> None:
    """On a host whose umask is 002 (a group's shared work folder), the files the supervisor writes in the run
    folder (streams, pid, exit code) are its user's alone; the worker itself runs under the host's umask, so what
    it adds to a team's shared caches stays readable to the team."""
    run_dir = new_run(tmp_path)
    python = fake_python(tmp_path, "umask > worker_umask")
    saved = os.umask(0o002)
    try:
        start_worker(transport, str(run_dir), python, code_dir(tmp_path), {})
    finally:
        os.umask(saved)
    assert wait_until(lambda: (run_dir / EXIT_CODE_FILE).exists())
    assert (run_dir / "worker_umask").read_text().strip() == "0002"
    for name in (PID_FILE, EXIT_CODE_FILE, "stdout.log", "stderr.log"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name
