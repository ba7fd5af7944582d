"""The trust boundary, in-process: what the tool believes (the user's own config and state folder) and what it
checks before acting (every tag, every file in a run or state folder, every pid). Each class of forgery gets its
one-line refusal or the correct outcome; nothing is signalled but a proven worker, nothing is written outside
the run folder, nothing a link points at is read or uploaded.

The same rules over a real sshd, MLflow server and Slurm: tests/test_trust_e2e.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.cli import app, run_ref
from orchestrator.config.settings import Command
from orchestrator.config.validation import ConfigError
from orchestrator.host.proof import RunFacts
from orchestrator.host.ssh import _AcceptNew, known_hosts_entry
from orchestrator.host.transport import HostKeyRefused, UnsafePath, inside
from orchestrator.stream.state import Launched, LocalFailure, StateStore
from orchestrator.sweep import slurm
from orchestrator.tracking import tags
from orchestrator.tracking.location import located
from remote_worker.safe_files import Folder, private_folder
from tests.fakes import FakeHost, FakeTracking, FakeWorker, decode_log, worker_histories
from tests.test_lifecycle import Terminal, job_config, run, the_run

ROOT = os.geteuid() == 0


# -- the safe file layer ------------------------------------------------------------------------------------------


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Folder, Path]:
    """A folder with a secret outside it, and a run folder inside it whose names can be made links to it."""
    secret = tmp_path / "secret"
    secret.write_text("the first line of a secret\n")
    secret.chmod(0o600)
    (tmp_path / "work" / "runs" / "r").mkdir(parents=True)
    return Folder(tmp_path / "work"), secret


def test_a_read_through_a_link_is_refused_and_reads_nothing(planted) -> None:
    folder, secret = planted
    assert secret.read_text().startswith("the first line")
    link = Path(folder.root) / "runs" / "r" / "events.jsonl"
    link.symlink_to(secret)
    for read in (lambda: folder.read("runs/r/events.jsonl"), lambda: folder.size("runs/r/events.jsonl")):
        with pytest.raises(UnsafePath, match=r"events.jsonl is a symbolic link; not followed"):
            read()
    with pytest.raises(UnsafePath):
        folder.copy_to("runs/r/events.jsonl", Path(folder.root) / "copy")
    assert not (Path(folder.root) / "copy").exists()


def test_a_folder_on_the_way_that_is_a_link_is_refused(planted, tmp_path: Path) -> None:
    folder, _secret = planted
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "spec.json").write_text("{}")
    (Path(folder.root) / "runs" / "linked").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="runs/linked is not a folder"):
        folder.read("runs/linked/spec.json")
    with pytest.raises(UnsafePath):
        folder.write_whole("runs/linked/cancel_requested", b"x")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["spec.json"]


def test_writes_replace_a_link_or_refuse_it_and_never_write_its_target(planted) -> None:
    folder, secret = planted
    run = Path(folder.root) / "runs" / "r"
    for name in ("cancel_requested", "spec.json", "events.jsonl", "stderr.log"):
        (run / name).symlink_to(secret)
    assert not folder.create("runs/r/cancel_requested", b"cancelled by the user\n"), "a link is an entry: not new"
    folder.write_whole("runs/r/spec.json", b"{}")  # the link itself is replaced by the file
    assert (run / "spec.json").is_file() and not (run / "spec.json").is_symlink()
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        folder.open_append("runs/r/events.jsonl")
    fd = folder.open_new("runs/r/stderr.log")  # an earlier attempt's entry goes, never written through
    os.close(fd)
    with pytest.raises(FileExistsError):
        folder.write_new("runs/r/cancel_requested", b"x")
    assert secret.read_text() == "the first line of a secret\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_a_fifo_is_refused_without_blocking(planted) -> None:
    folder, _ = planted
    os.mkfifo(Path(folder.root) / "runs" / "r" / "stderr.log")
    with pytest.raises(UnsafePath, match="is not a regular file"):
        folder.read("runs/r/stderr.log")


@pytest.mark.parametrize("path", ["/elsewhere/runs/x", "/w/../etc/passwd", "relative/x", "/w"])
def test_a_path_outside_the_work_folder_is_refused(path: str) -> None:
    with pytest.raises(UnsafePath):
        inside("/w", path)


# -- the state folder -------------------------------------------------------------------------------------------


def test_the_state_folder_is_made_private(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    store.check()
    for folder in (tmp_path / "state", tmp_path / "state" / "runs", tmp_path / "state" / "launched"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("flaw", ["group-writable", "symlink", "foreign"])
def test_a_state_folder_others_could_write_is_refused_in_one_line(
    tmp_path: Path, tracking: FakeTracking, capsys: pytest.CaptureFixture, flaw: str
) -> None:
    state = tmp_path / "state"
    if flaw == "group-writable":
        state.mkdir(mode=0o700)
        state.chmod(0o775)
        why = f"{state} is writable by its group (mode 0775)"
    elif flaw == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        state.symlink_to(tmp_path / "real")
        why = f"{state} is a symbolic link"
    else:
        if not ROOT:
            pytest.skip("giving a folder to another user needs root")
        state.mkdir(mode=0o700)
        os.chown(state, 65534, 65534)
        why = f"{state} is owned by uid 65534, not by you (uid 0)"
    host = FakeHost(FakeWorker(decode_log()))
    code = app.run_config(job_config(tmp_path), Console(), lambda _config: host)
    assert code == 1 and tracking.runs == {} and host.commands == []
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"local: orchestrator.state_dir {state}: {why}; only you may write the folder that says which run is yours "
        f"(`chmod 700 {state}`, or choose another with orchestrator.state_dir=...)"
    )


def test_links_at_the_states_lock_mirror_and_state_names_are_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("keep me\n")
    store = StateStore(tmp_path / "state")
    store.check()
    run_id = "a" * 32
    for name in (f"{run_id}.lock", f"{run_id}.events.jsonl"):
        (store.dir / name).symlink_to(secret)
    with pytest.raises(LocalFailure, match="is a symbolic link"):
        store.lock(run_id)
    from orchestrator.stream.mirror import EventMirror

    with pytest.raises(LocalFailure, match="is a symbolic link"):
        EventMirror(store.files, store.mirror_name(run_id), "/w/runs/x")
    assert secret.read_text() == "keep me\n"


# -- tags: hints checked like the command line ------------------------------------------------------------------

HOSTILE = {
    "empty": "",
    "newline": "box\nHost *\n  ProxyCommand touch /tmp/pwned",
    "escape": "\x1b]0;owned\x07\x1b[2J",
    "100 kB": "x" * 100_000,
    "negative": "-5",
    "huge": "9" * 30,
    "dotdot": "/host/work/../../etc",
    "absolute": "/etc",
    "option": "--user=x",
}
READ_BACK = (
    tags.HOST,
    tags.HOST_WORKDIR,
    tags.HOST_HOSTNAME,
    tags.HOST_PORT,
    tags.HOST_USER,
    tags.HOST_GATEWAY,
    tags.HOST_RUN_DIR,
    tags.MODEL,
    tags.LAST_SEQ,
    tags.OFFSET,
    tags.SLURM_JOB_ID,
    tags.SWEEP_JOB,
    tags.BEST_METHOD,
)


def _launched(tmp_path: Path, tracking: FakeTracking) -> tuple[FakeHost, object]:
    host = FakeHost(FakeWorker(decode_log(rounds=60), lines_per_look=1))
    run(job_config(tmp_path, "detach=true"), host)
    return host, the_run(tracking)


@pytest.mark.parametrize("command", ["attach", "logs", "cancel"])
@pytest.mark.parametrize("tag", READ_BACK)
def test_every_tag_read_back_with_every_hostile_value(
    tmp_path: Path, tracking: FakeTracking, tag: str, command: str
) -> None:
    """Each tag the tool reads back, set to each hostile value: the command refuses in one line (exit 1 or 2,
    nothing done) or does what it should (attach and cancel end the run, logs print it); whichever, no file
    outside the run's folder is touched, nothing but the run's own worker is signalled, nothing is uploaded
    but the run's own log and files, and no control character reaches the terminal."""
    for name, value in HOSTILE.items():
        tracking.runs.clear()
        host, job = _launched(tmp_path / name, tracking)
        job.tags[tag] = value
        before = {path for path in host.files if not path.startswith(host.run_dir + "/")}
        terminal = Terminal()
        with contextlib.redirect_stderr(io.StringIO()) as err:
            config = job_config(tmp_path / name, f"{command}={job.run_id}")
            code = app.run_config(config, terminal.console, lambda _config, host=host: host)
        said = terminal.text + err.getvalue()
        assert not any(ch in said for ch in "\x1b\x07"), (tag, name, said)
        assert {path for path in host.files if not path.startswith(host.run_dir + "/")} == before, (tag, name)
        assert set(job.artifacts) <= {"config.yaml", "events.jsonl", "stderr.log", "worker_log.txt"}, (tag, name)
        if code in (1, 2):
            lines = err.getvalue().strip().splitlines()
            assert len(lines) == 1 and host.signals_sent() == [], (tag, name, said)
            assert job.status == "RUNNING", (tag, name)
            continue
        assert code == 0, (tag, name, said)
        assert host.signals_sent() == (["-TERM"] if command == "cancel" else []), (tag, name)
        if command != "logs":
            assert job.status == ("KILLED" if command == "cancel" else "FINISHED"), (tag, name, said)


def test_a_forged_cursor_loses_no_metric(tmp_path: Path, tracking: FakeTracking) -> None:
    """`orchestrator.offset` and `orchestrator.last_seq` forged (huge, negative, or naming the wrong seq) on a
    run attached from another machine (no local state): the mismatch is said, the log is applied from its start,
    and MLflow holds exactly what the worker wrote."""
    for offset, last_seq in (("999999999", "999999"), ("-1", "5"), ("40", "2"), ("x", "1")):
        folder = tmp_path / f"{offset}-{last_seq}"
        host = FakeHost(FakeWorker(decode_log(), lines_per_look=100))
        run(job_config(folder, "detach=true"), host)
        job = the_run(tracking)
        while host.worker.state == "running":
            host._look()
        job.tags.update({tags.OFFSET: offset, tags.LAST_SEQ: last_seq})
        code, out = run(job_config(folder, f"attach={job.run_id}", f"orchestrator.state_dir={folder / 'other'}"), host)
        assert code == 0 and job.status == "FINISHED", out
        assert "stream cursor" in out and "applied from" in out
        assert job.history() == worker_histories(host.events_written(), None)
        tracking.runs.clear()


def test_connection_tags_are_reported_never_followed(tmp_path: Path) -> None:
    config = job_config(tmp_path, "host=localhost_ssh", "host.python=/usr/bin/python3", "host.port=2222")
    run_tags = {
        tags.HOST: "localhost_ssh",
        tags.HOST_WORKDIR: config.host.workdir,
        tags.HOST_HOSTNAME: "attacker.example",
        tags.HOST_PORT: "65536",
        tags.HOST_USER: "root@evil",
        tags.HOST_GATEWAY: "-oProxyCommand=sh",
    }
    where = located(config, "b" * 32, run_tags)
    assert where.run_dir == f"{config.host.workdir}/runs/{'b' * 32}"
    assert where.notes == [
        "run bbbbbbbb was launched with host.hostname=attacker.example; connecting with host.hostname=127.0.0.1 "
        "(host localhost_ssh's config and the command line: a tag is never followed)",
        "run bbbbbbbb: its tag host.port='65536' is outside 1..65535; ignored",
        "run bbbbbbbb: its tag host.user='root@evil' must be a user name (letters, digits, . - _); ignored",
        "run bbbbbbbb: its tag host.gateway='-oProxyCommand=sh' must be a gateway host, [user@]host[:port] "
        "('-oProxyCommand=sh' must be an address or a ~/.ssh/config alias (letters, digits, . - _; no user, space or "
        "@)); ignored",
    ]
    with pytest.raises(ConfigError, match=r"its tag host\.workdir='/w/\.\./x' must be an absolute path without"):
        located(config, "b" * 32, {**run_tags, tags.HOST_WORKDIR: "/w/../x"})


@pytest.mark.parametrize("hostname", ["box\n* ssh-ed25519 AAAA", "*", "[box]:22\n@cert-authority *", "-oProxy"])
def test_nothing_unchecked_goes_into_known_hosts(tmp_path: Path, hostname: str) -> None:
    known_hosts = tmp_path / "known_hosts"
    with pytest.raises(HostKeyRefused, match="its key is not written into known_hosts"):
        _AcceptNew(known_hosts).missing_host_key(None, hostname, None)  # type: ignore[arg-type]
    assert not known_hosts.exists()
    assert known_hosts_entry("[127.0.0.1]:2222") == "[127.0.0.1]:2222"


# -- pids: claims checked before any signal ---------------------------------------------------------------------


def test_a_pid_file_naming_someone_elses_process_is_never_signalled(tmp_path: Path, tracking: FakeTracking) -> None:
    host, job = _launched(tmp_path, tracking)
    host.foreign_uid = 1234  # the pid file now names another user's live process
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code, _ = run(job_config(tmp_path, f"cancel={job.run_id}"), host)
    assert code == 1 and host.signals_sent() == [] and job.status == "RUNNING"
    assert err.getvalue().strip() == (
        f"local: run {job.run_id[:8]} is not proven yours: pid 4242 belongs to uid 1234, not to you (uid 1000); "
        "nothing was changed"
    )


@pytest.mark.parametrize(
    ("facts", "problem"),
    [
        ("pid 1\n", "its pid file names pid 1, which is never signalled"),
        ("pid 77\n", "pid 77 is not alive"),
        ("pid 77\nproc 1000 12 12 1700000001\ncarries\n", "pid 77 does not lead its own process group (group 12)"),
        ("pid 77\nproc 1000 77 77 1600000000\ncarries\n", "pid 77 started before the run's folder was written"),
        ("pid 77\nproc 1000 77 77 1700000001\n", "pid 77 does not carry the run id cccccccc on its command line"),
        ("pid 77\nproc 1000 77 77 1700000001\ncarries\n", None),
    ],
)
def test_a_process_is_proven_the_runs_or_named_as_what_did_not_match(facts: str, problem: str | None) -> None:
    parsed = RunFacts.parse("me 1000\nfolder 1000 700\nspec_time 1700000000\n" + facts)
    found = parsed.process_problem("c" * 32)
    assert found == problem if problem is None else found.startswith(problem)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("folder link\n", "/w/runs/r (or a folder on its way from host.workdir) is a symbolic link"),
        ("folder missing\n", "/w/runs/r does not exist"),
        ("me 1000\nfolder 0 700\n", "/w/runs/r is owned by uid 0, not by you (uid 1000)"),
        ("me 1000\nfolder 1000 770\n", "/w/runs/r is writable by others (mode 770)"),
    ],
)
def test_a_folder_not_the_users_alone_is_not_the_runs(text: str, problem: str) -> None:
    assert RunFacts.parse(text).folder_problem("/w/runs/r") == problem


# -- last: this user's, from this machine, this shell's first -----------------------------------------------------


def _note(store: StateStore, run_id: str, started: float, session: int, sweep_job: int | None = None) -> None:
    store.note_launched(Launched(run_id, "local", "/host/work", f"run {run_id[:4]}", started, session, sweep_job))


def test_last_is_this_shells_newest_and_says_which_before_acting(tmp_path: Path) -> None:
    tracking = FakeTracking()
    store = StateStore(tmp_path / "state")
    here, other = os.getsid(0), os.getsid(0) + 1
    _note(store, "1" * 32, 100.0, here)
    _note(store, "2" * 32, 200.0, other, sweep_job=3)  # newer, another shell's sweep job
    terminal = Terminal()
    config = job_config(tmp_path, "attach=last")
    assert run_ref.find_run(tracking, config, store, terminal.console) == "1" * 32  # type: ignore[arg-type]
    assert terminal.text.startswith("last: run 11111111 'run 1111', started ")
    assert terminal.text.rstrip().endswith("from this shell")


def test_cancel_last_of_another_shells_sweep_job_asks_first(tmp_path: Path, monkeypatch) -> None:
    tracking = FakeTracking()
    store = StateStore(tmp_path / "state")
    _note(store, "2" * 32, 200.0, os.getsid(0) + 1, sweep_job=3)
    config = job_config(tmp_path, "cancel=last")
    monkeypatch.setattr(run_ref.sys.stdin, "isatty", lambda: False, raising=False)
    with pytest.raises(ConfigError, match=r"picked run 22222222 from another shell, sweep job #3: add yes=true"):
        run_ref.find_run(tracking, config, store, Terminal().console)  # type: ignore[arg-type]
    monkeypatch.setattr(run_ref.sys.stdin, "isatty", lambda: True, raising=False)
    asked = []
    with pytest.raises(ConfigError, match="was not cancelled"):
        run_ref.find_run(tracking, config, store, Terminal().console, lambda q: asked.append(q) or "n")  # type: ignore[arg-type]
    assert asked == ["cancel run 22222222 (from another shell, sweep job #3)? [y/N] "]
    assert run_ref.find_run(tracking, config, store, Terminal().console, lambda q: "y") == "2" * 32  # type: ignore[arg-type]
    yes = job_config(tmp_path, "cancel=last", "yes=true")
    assert run_ref.find_run(tracking, yes, store, Terminal().console, lambda q: "n") == "2" * 32  # type: ignore[arg-type]


def test_a_run_someone_else_created_in_the_store_is_never_last(tmp_path: Path, tracking: FakeTracking) -> None:
    _host, mine = _launched(tmp_path, tracking)
    forged = tracking.create_run(mine.experiment_id, tags=dict(mine.tags)).info.run_id  # newer, same tags
    terminal = Terminal()
    config = job_config(tmp_path, "logs=last")
    assert run_ref.find_run(tracking, config, StateStore(tmp_path / "state"), terminal.console) == mine.run_id
    assert forged != mine.run_id and config.command is Command.LOGS


# -- Slurm: a job id is a claim ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job_id", "fields", "problem"),
    [
        ("--user=x", {}, "the run's slurm.job_id tag '--user=x' is not a Slurm job id"),
        ("12;13", {}, "is not a Slurm job id"),
        ("12", {}, "Slurm knows no job 12"),
        ("12", {"UserId": "alice(4321)", "Comment": "ddtree-run:" + "d" * 32}, "belongs to alice(4321), not to you"),
        ("12", {"UserId": f"me({os.getuid()})", "Comment": "ddtree-run:" + "e" * 32}, "does not carry run dddddddd"),
        ("12_3", {"UserId": f"me({os.getuid()})", "Comment": "ddtree-run:" + "d" * 32}, None),
    ],
)
def test_a_slurm_job_is_cancelled_only_when_slurm_shows_it_is_the_users_and_the_runs(
    monkeypatch, job_id: str, fields: dict[str, str], problem: str | None
) -> None:
    monkeypatch.setattr(slurm, "job_fields", lambda _job: fields)
    found = slurm.slurm_job_problem(job_id, "d" * 32)
    assert found is None if problem is None else problem in found


def test_a_private_folder_refuses_what_others_could_write(tmp_path: Path) -> None:
    folder = tmp_path / "p"
    assert private_folder(folder) == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o757)
    with pytest.raises(UnsafePath, match="writable by every user"):
        private_folder(folder)
