"""A host-side failure names its cause: a host.python that is no (recent) Python, a work dir that is read-only,
unwritable or full; interrupted syncs leave no partial copies; an interrupted SFTP write returns at once.

Most tests run the real scripts on this machine through LocalTransport, with fake interpreters (shell scripts)
and fake tools on PATH. A read-only work dir is real: a folder of mode 0555 for a normal user, a read-only
bind mount in a private mount namespace (`unshare -m`) for root, for whom mode bits do not apply.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import paramiko
import pytest

from orchestrator.config.settings import HostConfig
from orchestrator.host import preflight as orchestrator_preflight
from orchestrator.host import sync
from orchestrator.host.local import LocalTransport
from orchestrator.host.preflight import PreflightFailed, _parse_workdir_answer, run_preflight, workdir_problem
from orchestrator.host.ssh import SSHTransport
from orchestrator.host.sync import COMPLETE_MARK, SyncFailed, sync_code
from orchestrator.host.transport import CommandResult
from remote_worker import preflight as host_preflight
from tests.sshd import SSHServer

MODEL = {"source": "random", "device": "cpu"}
ROOT = os.geteuid() == 0


def host(workdir: Path | str) -> HostConfig:
    return HostConfig.from_mapping(
        {"name": "box", "kind": "local", "workdir": str(workdir), "gpus": "none", "gpu_lock_dir": "/tmp/locks"}
    )


# An SSH host's settings as a host file gives them (conf/host/localhost_ssh.yaml), for transports that never connect.
SSH_HOST = {
    "name": "box",
    "kind": "ssh",
    "hostname": "box.invalid",
    "known_hosts": "~/.ssh/known_hosts",
    "workdir": "/w",
    "gpu_lock_dir": "/tmp/locks",
    "connect_timeout_s": 10,
    "keepalive_s": 2,
    "keepalive_count_max": 3,
}


def fake_python(tmp_path: Path, body: str, name: str = "python") -> str:
    """An executable shell script standing in for host.python."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def report(**changes: Any) -> dict[str, Any]:
    """A preflight report as the host script writes it, all well unless changed."""
    answer = {
        "python": "3.11.9",
        "torch": "2.5.0",
        "transformers": "4.46.0",
        "safetensors": "0.4.5",
        "numpy": "2.1.0",
        "gpus": [],
        "cuda": None,
        "flock": True,
        "workdir_free_gib": 100.0,
        "workdir_checked": "/w",
        "workdir_writable": True,
        "workdir_problem": None,
        "paths": {},
    }
    answer.update(changes)
    return answer


def reporting_python(tmp_path: Path, answer: dict[str, Any]) -> str:
    """A host.python that answers the preflight with `answer`."""
    return fake_python(tmp_path, f"printf '%s\\n' {shlex.quote(json.dumps(answer))}")


def preflight_error(python: str, workdir: Path | str = "/w") -> str:
    with pytest.raises(PreflightFailed) as failed:
        run_preflight(LocalTransport(), host(workdir), MODEL, python)
    return str(failed.value)


# -- host.python ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ('exec /bin/echo "$@"', '-c """What a host offers, as one JSON line'),
        ("exit 0", "no output"),
        ("exit 1", "no output"),
        ("echo 'hello from a login banner'; echo '{not json'; exit 0", "hello from a login banner"),
        ("echo '[1, 2]'", "[1, 2]"),
        ("echo 'usage: tool [-x]' >&2; exit 2", "usage: tool [-x]"),
    ],
)
def test_a_host_python_that_is_not_a_python_is_named(tmp_path: Path, body: str, said: str) -> None:
    python = fake_python(tmp_path, body)
    message = preflight_error(python)
    assert message.startswith(f"box: host.python {python} is not a Python interpreter (it did not run the preflight")
    assert said in message
    assert "JSONDecodeError" not in message and "\n" not in message


def test_real_non_pythons_are_named(tmp_path: Path) -> None:
    for program in ("/bin/echo", "/bin/true"):
        if Path(program).exists():
            assert f"host.python {program} is not a Python interpreter" in preflight_error(program)


def test_a_missing_or_unexecutable_host_python_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "python3")
    assert preflight_error(missing) == f"box: the interpreter {missing} does not exist there (host.python)"
    plain = tmp_path / "python3"
    plain.write_text("not a program\n")
    plain.chmod(0o644)  # no execute bit for anyone: refused even to root
    message = preflight_error(str(plain))
    assert message.startswith(f"box: the interpreter {plain} cannot be executed there (host.python): ")
    assert "ermission denied" in message


def test_a_python_too_old_to_parse_the_check_says_its_version(tmp_path: Path) -> None:
    python = fake_python(
        tmp_path,
        'if [ "$1" = -V ]; then echo "Python 2.7.18" >&2; exit 0; fi\n'
        "printf '  File \"<string>\", line 8\\nSyntaxError: future feature annotations is not defined\\n' >&2; exit 1",
    )
    assert preflight_error(python) == f"box: host.python {python} is Python 2.7.18; the worker needs Python >= 3.10"


def test_a_python_too_old_without_a_version_names_the_error(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "echo 'SyntaxError: invalid syntax' >&2; exit 1")
    assert preflight_error(python) == (
        f"box: host.python {python} could not run the preflight check: SyntaxError: invalid syntax "
        "(the worker needs Python >= 3.10)"
    )


def test_a_python_that_runs_the_check_but_is_too_old_is_refused(tmp_path: Path) -> None:
    python = reporting_python(tmp_path, report(python="3.8.10"))
    assert preflight_error(python) == f"box: host.python {python} is Python 3.8.10; the worker needs Python >= 3.10"


def test_a_broken_python_names_its_last_error(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "printf 'Traceback (most recent call last):\\nImportError: no site\\n' >&2; exit 1")
    assert (
        preflight_error(python) == f"box: host.python {python} could not run the preflight check: ImportError: no site"
    )


# -- the work dir, as the preflight reports it ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"workdir_free_gib": 0.0},
            f"box: host.workdir /w: no space left (0.0 GiB free, at least {orchestrator_preflight.MIN_FREE_GIB} "
            "GiB needed)",
        ),
        (
            {"workdir_writable": False, "workdir_problem": "read-only file system", "workdir_checked": "/w"},
            "box: host.workdir /w: read-only file system",
        ),
        (
            {"workdir_writable": False, "workdir_problem": "permission denied", "workdir_checked": "/"},
            "box: host.workdir /w: permission denied (/, where it would be created)",
        ),
        (
            {"workdir_writable": False, "workdir_problem": "not a directory", "workdir_checked": "/w"},
            "box: host.workdir /w: /w is not a directory",
        ),
        (
            # A read-only mount often shows no free space too: the read-only part is the cause to name.
            {"workdir_free_gib": 0.0, "workdir_problem": "read-only file system", "workdir_checked": "/w"},
            "box: host.workdir /w: read-only file system",
        ),
    ],
)
def test_work_dir_problems_name_host_workdir(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    assert preflight_error(reporting_python(tmp_path, report(**changes))) == message


def test_a_report_without_the_new_fields_still_passes(tmp_path: Path) -> None:
    old = report()
    for key in ("workdir_checked", "workdir_writable", "workdir_problem"):
        del old[key]
    assert run_preflight(LocalTransport(), host("/w"), MODEL, reporting_python(tmp_path, old))["python"] == "3.11.9"


def test_the_host_script_reports_the_work_dir_without_writing(tmp_path: Path, monkeypatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    before = sorted(tmp_path.rglob("*"))
    assert host_preflight.workdir_report(str(work)) | {"workdir_free_gib": None} == {
        "workdir_free_gib": None,
        "workdir_checked": str(work),
        "workdir_writable": True,
        "workdir_problem": None,
    }
    deeper = host_preflight.workdir_report(str(work / "not" / "yet"))
    assert (deeper["workdir_checked"], deeper["workdir_problem"]) == (str(work), None)
    (tmp_path / "file").write_text("")
    in_file = host_preflight.workdir_report(str(tmp_path / "file" / "runs"))
    assert (in_file["workdir_checked"], in_file["workdir_problem"]) == (str(tmp_path / "file"), "not a directory")
    assert sorted(tmp_path.rglob("*")) == sorted([*before, tmp_path / "file"]), "nothing written"

    # What the kernel answers for a read-only mount (EROFS) and for a refused permission.
    monkeypatch.setattr(host_preflight.os, "access", lambda path, mode: False)
    real = {name: getattr(os.statvfs(work), name) for name in dir(os.statvfs(work)) if name.startswith("f_")}
    read_only = SimpleNamespace(**{**real, "f_flag": real["f_flag"] | os.ST_RDONLY})
    monkeypatch.setattr(host_preflight.os, "statvfs", lambda path: read_only)
    assert host_preflight.workdir_report(str(work))["workdir_problem"] == "read-only file system"
    read_write = SimpleNamespace(**{**real, "f_flag": real["f_flag"] & ~os.ST_RDONLY})
    monkeypatch.setattr(host_preflight.os, "statvfs", lambda path: read_write)
    answer = host_preflight.workdir_report(str(work / "new"))
    assert answer["workdir_problem"] == "permission denied" and answer["workdir_writable"] is False


def test_the_real_preflight_keeps_every_field(tmp_path: Path) -> None:
    answer = run_preflight(LocalTransport(), host(tmp_path / "work"), MODEL, sys.executable)
    assert {"gpus", "cuda", "torch", "transformers", "python", "flock", "paths", "workdir_free_gib"} <= set(answer)
    assert answer["workdir_writable"] is True and answer["workdir_checked"] == str(tmp_path)


def test_the_preflight_reads_versions_without_importing_and_says_what_cannot_be_found(tmp_path: Path) -> None:
    """Installed packages are found and their versions read from their metadata, not imported (a sweep pays the
    check once a job): a `torch` whose import would fail still reports its version and its build's CUDA,
    read from its version file; a package that is not there at all is None, and named by the orchestrator."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('imported')\n")
    (site / "torch" / "version.py").write_text("from typing import Optional\ncuda: Optional[str] = '12.8'\n")
    (site / "torch-9.1.dist-info").mkdir()
    (site / "torch-9.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.1\n")
    done = subprocess.run(
        [sys.executable, "-c", orchestrator_preflight.SCRIPT.read_text(), "--workdir", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(site)},  # ahead of the venv's own torch
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    answer = json.loads(done.stdout)
    assert (answer["torch"], answer["cuda"]) == ("9.1", "12.8")
    assert host_preflight._version("no_such_package_here") is None


# -- a really unwritable work dir ---------------------------------------------------------------------------


class FakeSSH(LocalTransport):
    """This machine, standing in for an SSH host: commands optionally run through `prefix`; a connection that
    is up or not; `write_file` that can be made to fail halfway."""

    def __init__(self, prefix: Sequence[str] = (), connected: bool = True, fail_write: BaseException | None = None):
        super().__init__("box")
        self.prefix = list(prefix)
        self.host = HostConfig.from_mapping({**SSH_HOST, "hostname": "box.invalid"})
        self.hostname = "box.invalid"
        self._connection = SimpleNamespace(is_connected=connected)
        self.fail_write = fail_write
        self.commands: list[Sequence[str]] = []

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> CommandResult:
        self.commands.append(argv)
        return super().run([*self.prefix, *argv], env=env, check=check)

    def write_file(self, path: str, data: bytes, mode: int, *, exclusive: bool = False) -> None:
        if self.fail_write is None:
            return super().write_file(path, data, mode, exclusive=exclusive)
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        raise self.fail_write

    @property
    def connected(self) -> bool:
        return self._connection.is_connected

    def openssh_command(self) -> list[str]:
        raise AssertionError("no OpenSSH client for a fake host")


@pytest.fixture
def unwritable(tmp_path: Path):
    """(a folder nothing can be written in, a transport that sees it so, how the host script names it)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if not ROOT:
        folder.chmod(0o555)
        yield folder, FakeSSH(), "permission denied"
        folder.chmod(0o755)
        return
    if shutil.which("unshare") is None:
        pytest.skip("root needs unshare(1) for a read-only mount (mode bits do not stop root)")
    script = 'mount --bind -o ro "$0" "$0" || exit 99; exec "$@"'
    prefix = ["unshare", "-m", "sh", "-c", script, str(folder)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private read-only bind mount here: {probe.stderr.strip()}")
    yield folder, FakeSSH(prefix), "read-only file system"


def test_an_unwritable_work_dir_fails_the_preflight_by_name(unwritable) -> None:
    folder, transport, problem = unwritable
    with pytest.raises(PreflightFailed) as failed:
        run_preflight(transport, host(folder / "runs"), MODEL, sys.executable)
    assert str(failed.value) == f"box: host.workdir {folder / 'runs'}: {problem} ({folder}, where it would be created)"


def test_workdir_problem_names_an_unwritable_work_dir(unwritable) -> None:
    folder, transport, problem = unwritable
    expected = "read-only file system" if problem == "read-only file system" else "not writable"
    assert workdir_problem(transport, str(folder), sys.executable) == f"host.workdir {folder}: {expected}"
    assert workdir_problem(transport, str(folder), None) == f"host.workdir {folder}: not writable"


def test_a_sync_into_an_unwritable_work_dir_names_it(unwritable, tmp_path: Path) -> None:
    folder, transport, _problem = unwritable
    with pytest.raises(SyncFailed) as failed:
        sync_code(transport, str(folder), root=worker_tree(tmp_path / "tree"), method="tar")
    assert str(failed.value).startswith(f"host.workdir {folder}: ")
    assert "sh -c" not in str(failed.value) and "if [" not in str(failed.value)


# -- workdir_problem ------------------------------------------------------------------------------------------


def test_workdir_problem_sees_nothing_wrong_with_a_healthy_dir(tmp_path: Path) -> None:
    assert workdir_problem(LocalTransport(), str(tmp_path), sys.executable) is None
    assert workdir_problem(LocalTransport(), str(tmp_path / "not" / "yet"), None) is None
    (tmp_path / "file").write_text("")
    assert workdir_problem(LocalTransport(), str(tmp_path / "file"), None) == (
        f"host.workdir {tmp_path / 'file'}: {tmp_path / 'file'} is not a directory"
    )


def fake_df(tmp_path: Path, monkeypatch, free_kib: int, inodes: tuple[int, int] = (1000, 900)) -> None:
    """A `df` first on PATH that reports `free_kib` KiB and (inodes, free inodes)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    total, left = inodes
    fake_python(
        bin_dir,
        'if [ "$1" = -Pi ]; then echo "Filesystem Inodes IUsed IFree IUse% Mounted on"; '
        f'echo "/dev/x {total} {total - left} {left} 1% /"; exit 0; fi\n'
        'echo "Filesystem 1024-blocks Used Available Capacity Mounted on"\n'
        f'echo "/dev/x 1000000 {1000000 - free_kib} {free_kib} 100% /"',
        name="df",
    )
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_workdir_problem_names_a_full_disk(tmp_path: Path, monkeypatch) -> None:
    fake_df(tmp_path, monkeypatch, free_kib=12)
    assert (
        workdir_problem(LocalTransport(), str(tmp_path), None)
        == f"host.workdir {tmp_path}: no space left (12 KiB free)"
    )
    assert workdir_problem(LocalTransport(), str(tmp_path / "runs"), None) == (
        f"host.workdir {tmp_path / 'runs'}: no space left (12 KiB free) ({tmp_path}, where it would be created)"
    )


def test_workdir_problem_names_no_inodes_left(tmp_path: Path, monkeypatch) -> None:
    fake_df(tmp_path, monkeypatch, free_kib=10_000_000, inodes=(1000, 0))
    assert workdir_problem(LocalTransport(), str(tmp_path), None) == (
        f"host.workdir {tmp_path}: no inodes left (no file can be created)"
    )


def test_workdir_problem_ignores_plenty_of_space_and_file_systems_without_inode_counts(
    tmp_path: Path, monkeypatch
) -> None:
    fake_df(tmp_path, monkeypatch, free_kib=2048, inodes=(0, 0))  # btrfs and others report no inodes
    assert workdir_problem(LocalTransport(), str(tmp_path), None) is None


def test_workdir_problem_never_raises_on_a_failed_command() -> None:
    class Failing(LocalTransport):
        def run(self, argv, *, env=None, check=True):
            assert check is False
            return CommandResult(2, "", "sh: cannot fork")

    assert workdir_problem(Failing(), "/w", None) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("checked /w\nfree_kib 500000\ninodes 100 50\nwritable\n", None),
        ("checked /w\nfree_kib 0\ninodes 100 50\nwritable\n", "host.workdir /w: no space left (0 KiB free)"),
        ("checked /w\nfree_kib 1023\nwritable\n", "host.workdir /w: no space left (1023 KiB free)"),
        ("checked /w\nfree_kib 1024\nwritable\n", None),
        ("checked /w\nfree_kib 0\nreadonly\nnotwritable\n", "host.workdir /w: read-only file system"),
        (
            "checked /\nfree_kib 9999\nreadwrite\nnotwritable\n",
            "host.workdir /w: not writable (/, where it would be created)",
        ),
        ("checked /w\nnotdir\n", "host.workdir /w: /w is not a directory"),
        ("", None),
        ("garbage\n\n", None),
    ],
)
def test_parse_workdir_answer(text: str, expected: str | None) -> None:
    assert _parse_workdir_answer("/w", text) == expected


# -- partial copies -------------------------------------------------------------------------------------------


def worker_tree(root: Path, big: int = 0) -> Path:
    """A checkout with a small worker package (and a `big`-byte file that does not compress)."""
    (root / "remote_worker").mkdir(parents=True)
    (root / "remote_worker" / "__init__.py").write_text("")
    (root / "remote_worker" / "runner.py").write_text("print('run')\n")
    if big:
        (root / "remote_worker" / "weights.bin").write_bytes(os.urandom(big))
    return root


def leftovers(workdir: Path) -> list[str]:
    code = workdir / "code"
    return sorted(p.name for p in code.iterdir() if ".part-" in p.name) if code.exists() else []


def look(transport: LocalTransport, code_root: Path, minutes: str) -> str:
    return transport.run(["sh", "-c", sync._LOOK, "look", str(code_root), "f" * 16, minutes]).stdout


def test_looking_sweeps_parts_nothing_changed_in_for_a_while(tmp_path: Path) -> None:
    code = tmp_path / "code"
    (code / "abc.part-17" / "remote_worker").mkdir(parents=True)
    (code / "abc.part-17" / "remote_worker" / "runner.py").write_text("x")
    (code / "abc.part-18.tar.gz").write_bytes(b"half")
    (code / "old" / "remote_worker").mkdir(parents=True)
    (code / "old" / COMPLETE_MARK).write_text("")
    transport = LocalTransport()
    said = look(transport, code, "10")
    assert sorted(p.name for p in code.iterdir()) == ["abc.part-17", "abc.part-18.tar.gz", "old"], "fresh: kept"
    assert "pid " in said and f"newest {code}/old" in said
    # ctime cannot be set back: "nothing changed in the last 0 minutes" holds for every part.
    look(transport, code, "0")
    assert sorted(p.name for p in code.iterdir()) == ["old"], "stale parts are removed, snapshots are not"
    assert "pid " in look(transport, tmp_path / "missing" / "code", "10"), "no code folder yet is fine"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), SystemExit(130)])
def test_an_interrupted_copy_removes_its_part(tmp_path: Path, interrupt: BaseException) -> None:
    workdir = tmp_path / "remote"
    transport = FakeSSH(fail_write=interrupt)
    started = time.monotonic()
    with pytest.raises(type(interrupt)):
        sync_code(transport, str(workdir), root=worker_tree(tmp_path / "tree"), method="tar")
    assert time.monotonic() - started < sync.CLEANUP_TIMEOUT_S
    assert leftovers(workdir) == []
    assert (workdir / "code").exists()


def test_a_failed_untar_removes_its_part_and_names_the_work_dir(tmp_path: Path) -> None:
    workdir = tmp_path / "remote"
    transport = FakeSSH()
    transport.write_file = lambda path, data, mode, **_: Path(path).write_bytes(b"not a tar")  # type: ignore[method-assign]
    with pytest.raises(SyncFailed) as failed:
        sync_code(transport, str(workdir), root=worker_tree(tmp_path / "tree"), method="tar")
    message = str(failed.value)
    assert message.startswith(f"copying the worker's code to host.workdir {workdir} failed: ")
    assert "sh -c" not in message
    assert leftovers(workdir) == []


def test_a_failed_copy_on_a_full_disk_says_so(tmp_path: Path, monkeypatch) -> None:
    workdir = tmp_path / "remote"
    transport = FakeSSH(fail_write=OSError(28, "Failure"))
    fake_df(tmp_path, monkeypatch, free_kib=0)
    with pytest.raises(SyncFailed) as failed:
        sync_code(transport, str(workdir), root=worker_tree(tmp_path / "tree"), method="tar")
    assert str(failed.value) == f"host.workdir {workdir}: no space left (0 KiB free)"
    assert leftovers(workdir) == []


def test_removing_a_part_never_waits_long(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sync, "CLEANUP_TIMEOUT_S", 0.5)

    class Hanging(FakeSSH):
        def run(self, argv, *, env=None, check=True):
            if argv[0] == "rm":
                time.sleep(30)  # a link that died mid-command
            return super().run(argv, env=env, check=check)

    transport = Hanging(fail_write=KeyboardInterrupt())
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        sync_code(transport, str(tmp_path / "remote"), root=worker_tree(tmp_path / "tree"), method="tar")
    assert time.monotonic() - started < 5


def test_without_a_connection_or_ssh_the_sweep_is_left_to_do_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sync.shutil, "which", lambda name: None)
    transport = FakeSSH(fail_write=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        sync_code(transport, str(tmp_path / "remote"), root=worker_tree(tmp_path / "tree"), method="tar")
    transport._connection.is_connected = False  # as after an interrupted SFTP write
    transport.commands.clear()
    with pytest.raises(KeyboardInterrupt):
        sync_code(transport, str(tmp_path / "remote"), root=worker_tree(tmp_path / "tree2"), method="tar")
    assert [argv[0] for argv in transport.commands] == ["sh"], "only the look: nothing is tried without a link"


# -- write_file -----------------------------------------------------------------------------------------------


class FakeFile:
    def __init__(self, fail_at: int, error: BaseException) -> None:
        self.fail_at, self.error = fail_at, error
        self.chunks: list[int] = []
        self.closed = False

    def chmod(self, mode: int) -> None:
        self.mode = mode

    def set_pipelined(self, pipelined: bool) -> None:
        pass

    def write(self, data: bytes) -> None:
        if len(self.chunks) == self.fail_at:
            raise self.error
        self.chunks.append(len(data))

    def close(self) -> None:
        time.sleep(30)  # what paramiko's close does over a cut link: wait for every pipelined acknowledgement
        self.closed = True


class FakeSFTP:
    def __init__(self, file: FakeFile) -> None:
        self.file, self.closed = file, False

    def open(self, path: str, mode: str) -> FakeFile:
        return self.file

    def close(self) -> None:
        self.closed = True


def test_an_interrupted_sftp_write_drops_the_connection_instead_of_waiting(tmp_path: Path) -> None:
    config = {**SSH_HOST, "hostname": "127.0.0.1", "port": 9, "known_hosts": str(tmp_path / "known_hosts")}
    transport = SSHTransport(HostConfig.from_mapping({**config, "connect_timeout_s": 1}))
    file = FakeFile(fail_at=2, error=KeyboardInterrupt())
    sftp = FakeSFTP(file)
    transport._sftp = sftp  # type: ignore[assignment]
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        transport.sftp_write("/w/x", b"z" * (5 << 20), 0o600)  # what write_file sends its bytes through
    assert time.monotonic() - started < 2
    assert file.chunks == [1 << 20, 1 << 20], "written in 1 MiB chunks"
    assert not file.closed and sftp.closed and transport._sftp is None


# -- over a real sshd ----------------------------------------------------------------------------------------


def failing_sftp_writes(monkeypatch, error: BaseException, at: int = 1) -> None:
    """Make the `at`-th chunk of the next SFTP file write raise `error` (after earlier chunks went out)."""
    real = paramiko.SFTPFile.write
    calls = []

    def write(self: paramiko.SFTPFile, data: bytes) -> None:
        calls.append(len(data))
        if len(calls) == at + 1:
            raise error
        real(self, data)

    monkeypatch.setattr(paramiko.SFTPFile, "write", write)


@pytest.mark.slow
def test_interrupted_and_failed_tar_syncs_over_ssh_leave_no_parts(sshd: SSHServer, tmp_path: Path, monkeypatch) -> None:
    tree = worker_tree(tmp_path / "tree", big=3 << 20)
    workdir = tmp_path / "remote"
    transport = SSHTransport(sshd.host_config(workdir))
    try:
        with monkeypatch.context() as patch:
            failing_sftp_writes(patch, KeyboardInterrupt())
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                sync_code(transport, str(workdir), root=tree, method="tar")
            assert time.monotonic() - started < sync.CLEANUP_TIMEOUT_S + 2
        assert not transport._connection.is_connected, "the interrupted write dropped the connection"
        if shutil.which("ssh"):
            assert leftovers(workdir) == [], "removed through the OpenSSH client"

        with monkeypatch.context() as patch:
            failing_sftp_writes(patch, OSError("Failure"))  # what the SFTP server answers on a full disk
            with pytest.raises(SyncFailed) as failed:
                sync_code(transport, str(workdir), root=tree, method="tar")
        assert str(failed.value) == (f"copying the worker's code to host.workdir {workdir} failed: OSError: Failure")
        assert transport._connection.is_connected, "an error the server answered with keeps the connection"
        assert leftovers(workdir) == []

        snapshot, copied = sync_code(transport, str(workdir), root=tree, method="tar")
        assert copied and (Path(snapshot) / "remote_worker" / "weights.bin").stat().st_size == 3 << 20
        assert leftovers(workdir) == []
    finally:
        transport.close()


# -- the worker's code runs only from a snapshot no one else could write ------------------------------------------


@pytest.mark.parametrize("planted", ["group-writable file", "link", "foreign owner"])
def test_a_snapshot_someone_else_could_have_written_is_never_run(tmp_path: Path, planted: str) -> None:
    """A snapshot named with this tree's hash, present in the work folder, whose files another user could have
    written (or a link): the sync refuses in one line and nothing is started from it."""
    tree = worker_tree(tmp_path / "tree")
    workdir = tmp_path / "remote"
    transport = FakeSSH()
    snapshot, copied = sync_code(transport, str(workdir), root=tree, method="tar")
    assert copied
    runner = Path(snapshot) / "remote_worker" / "runner.py"
    assert stat.S_IMODE(runner.stat().st_mode) & 0o022 == 0, "extracted writable by its owner alone"
    if planted == "group-writable file":
        runner.chmod(0o664)
        bad = runner
    elif planted == "link":
        runner.unlink()
        runner.symlink_to(tmp_path / "elsewhere.py")
        bad = runner
    else:
        if not ROOT:
            pytest.skip("giving a file to another user needs root")
        os.chown(runner, 65534, 65534)
        bad = runner
    with pytest.raises(SyncFailed) as refused:
        sync_code(transport, str(workdir), root=tree, method="tar")
    assert str(refused.value) == (
        f"host.workdir {workdir}: {bad} is a link, not yours, or writable by others: the worker's code is never run "
        "from there (remove it, or choose another host.workdir)"
    )


def test_an_untrusted_snapshot_is_never_linked_from(tmp_path: Path) -> None:
    """`--link-dest` hard-links unchanged files from the newest snapshot: one others could write is not offered."""
    code = tmp_path / "code"
    (code / "old" / "remote_worker").mkdir(parents=True)
    (code / "old" / COMPLETE_MARK).write_text("")
    (code / "old" / "remote_worker" / "runner.py").write_text("x")
    assert f"newest {code / 'old'}" in look(LocalTransport(), code, "10")
    (code / "old" / "remote_worker" / "runner.py").chmod(0o666)
    assert "newest" not in look(LocalTransport(), code, "10")
