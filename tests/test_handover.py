"""Every file one process writes and another polls is read whole or not at all.

Each test runs the real writer in one process, thousands of times, while another process runs the real
reader as fast as it can; a read that is neither "not there yet" nor one of the values written fails.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.config.handover import read_whole, sh_write_whole, write_first, write_whole
from orchestrator.host import launch, leases, run_folder
from orchestrator.sweep import host_pool, job_errors, membership, slurm

WRITES = 3000


def _poll(read: Callable[[], object], ok: Callable[[object], bool], stop: Path, out: Path) -> None:
    """The reader's process: read until `stop` appears; write how many reads were whole and the bad ones."""
    reads, bad = 0, []
    while not stop.exists():
        value = read()
        reads += 1
        if not ok(value):
            bad.append(repr(value))
    out.write_text(json.dumps({"reads": reads, "bad": bad[:5], "bad_count": len(bad)}))


def race(
    tmp_path: Path, write: Callable[[int], None], read: Callable[[], object], ok: Callable[[object], bool]
) -> dict:
    """Run `write(i)` WRITES times here while a forked process polls `read`; the reader's tally."""
    stop, out = tmp_path / "stop", tmp_path / "tally.json"
    reader = multiprocessing.get_context("fork").Process(target=_poll, args=(read, ok, stop, out))
    reader.start()
    try:
        for i in range(WRITES):
            write(i)
    finally:
        stop.touch()
        reader.join(60)
    tally = json.loads(out.read_text())
    assert tally["reads"] > 0
    return tally


def assert_whole(tally: dict) -> None:
    assert tally["bad_count"] == 0, f"{tally['bad_count']} of {tally['reads']} reads were partial: {tally['bad']}"


REASON = "job #3 failed: the worker exited with code 1 " + "x" * 2000


def test_the_cancel_mark_is_read_with_its_reason(tmp_path: Path) -> None:
    sweep = membership.Sweep(tmp_path, "parent", 0, True)

    def write(_i: int) -> None:
        (tmp_path / membership.CANCELLED_FILE).unlink(missing_ok=True)
        sweep.cancel(REASON)

    tally = race(tmp_path, write, lambda: membership.cancel_reason(tmp_path), lambda r: r in (None, REASON))
    assert_whole(tally)


def test_the_first_cancel_reason_is_kept(tmp_path: Path) -> None:
    sweep = membership.Sweep(tmp_path, "parent", 0, True)
    sweep.cancel("first")
    sweep.cancel("second")
    assert membership.cancel_reason(tmp_path) == "first"
    assert [p.name for p in tmp_path.iterdir()] == [membership.CANCELLED_FILE]  # no scratch file left behind


def test_the_sweep_record_is_read_whole(tmp_path: Path) -> None:
    records = [{"parent_run_id": f"run{i}", "experiment_id": "1", "jobs": 8, "swept": ["x"] * 300} for i in (0, 1)]
    membership.write_sweep_record(tmp_path, records[0])
    tally = race(
        tmp_path,
        lambda i: membership.write_sweep_record(tmp_path, records[i % 2]),
        lambda: membership.read_sweep_record(tmp_path),
        lambda r: r in records,
    )
    assert_whole(tally)


def test_a_slurm_jobs_run_record_is_read_whole(tmp_path: Path) -> None:
    job = slurm.SlurmJob("123_4", "4")
    runs = [slurm.StartedRun("a" * 32, "1"), slurm.StartedRun("b" * 32, "2")]
    slurm.record_run(tmp_path, job, runs[0])

    def read() -> object:
        path = tmp_path / slurm.RUN_RECORD
        text = read_whole(path)
        return None if text is None else json.loads(text)  # a partial record raises here

    tally = race(tmp_path, lambda i: slurm.record_run(tmp_path, job, runs[i % 2]), read, lambda r: r is not None)
    assert_whole(tally)


def test_a_pool_turn_marker_is_read_whole(tmp_path: Path) -> None:
    turns = host_pool.Turns(tmp_path, 0, ["a", "b"])
    turns.enter()
    texts = {f"waiting {os.uname().nodename} {os.getpid()} a,b\n", "done\n"}
    tally = race(
        tmp_path,
        lambda i: turns.leave() if i % 2 else turns.enter(),
        lambda: read_whole(tmp_path / "0"),
        lambda r: r in texts,
    )
    assert_whole(tally)


def test_a_jobs_error_line_is_read_whole(tmp_path: Path) -> None:
    lines = [f"config: {'x' * 3000} {i}" for i in (0, 1)]
    job_errors.record_runless(tmp_path / "3", lines[0])
    tally = race(
        tmp_path,
        lambda i: job_errors.record_runless(tmp_path / "3", lines[i % 2]),
        lambda: job_errors.runless_jobs(tmp_path, 0.0).get(3),
        lambda r: r in lines,
    )
    assert_whole(tally)


def test_write_whole_and_write_first_leave_no_scratch_files(tmp_path: Path) -> None:
    write_whole(tmp_path / "a", "one")
    write_whole(tmp_path / "a", "two")
    assert write_first(tmp_path / "b", "first") and not write_first(tmp_path / "b", "second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert read_whole(tmp_path / "a") == "two" and read_whole(tmp_path / "missing") is None


# -- the host's files, written by the supervisor's and the probe's shell scripts -----------------------------


def _sh_loop(body: str, folder: Path) -> subprocess.Popen:
    """`body` run WRITES times by sh in `folder` (as the supervisor and the probe run theirs)."""
    return subprocess.Popen(["sh", "-c", f"i=0; while [ $i -lt {WRITES} ]; do {body}; i=$((i + 1)); done"], cwd=folder)


def _looks(writer: subprocess.Popen, folder: Path) -> list[str]:
    """The status script's answers, asked again and again while `writer` runs."""
    seen = []
    while writer.poll() is None:
        argv = ["sh", "-c", run_folder._STATUS, "status", str(folder)]
        seen.append(subprocess.run(argv, capture_output=True, text=True).stdout.strip())
    assert writer.returncode == 0
    return seen


def test_the_workers_pid_is_never_read_half_written(tmp_path: Path) -> None:
    """The status script reads `pid` while the supervisor writes it: a live worker is never `vanished` (or
    without its pid) because the pid was read empty."""
    assert launch._SUPERVISE.startswith(sh_write_whole("$$", run_folder.PID_FILE))  # the supervisor's own write
    sleeper = subprocess.Popen(["setsid", "sleep", "120"])
    try:
        time.sleep(0.2)
        seen = _looks(_sh_loop(sh_write_whole(str(sleeper.pid), run_folder.PID_FILE), tmp_path), tmp_path)
        wrong = [s for s in seen if s not in ("starting", f"running {sleeper.pid}")]
        assert not wrong, f"{len(wrong)} of {len(seen)} looks misread the pid: {wrong[:3]}"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_exit_code_is_never_read_half_written(tmp_path: Path) -> None:
    assert launch._SUPERVISE.endswith(sh_write_whole("$code", run_folder.EXIT_CODE_FILE))
    (tmp_path / run_folder.PID_FILE).write_text("999999999\n")  # no such process: without an exit code, vanished
    seen = _looks(_sh_loop(sh_write_whole("137", run_folder.EXIT_CODE_FILE), tmp_path), tmp_path)
    wrong = [s for s in seen if s not in ("exited 137", "vanished 999999999")]
    assert not wrong, f"{len(wrong)} of {len(seen)} looks misread the exit code: {wrong[:3]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_folder.EXIT_CODE_FILE, run_folder.PID_FILE]


@pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) is not installed")
def test_a_gpu_claim_is_never_read_half_written(tmp_path: Path) -> None:
    """While the probe's own claim on GPU 0 is written again and again (a time an hour ahead), a probe
    never sees GPU 0 free."""
    locks = tmp_path / "locks"
    locks.mkdir()
    claim = sh_write_whole("$((now + ttl))", leases.GPU_CLAIM, leases.CLAIM_SCRATCH)
    assert claim in leases._PROBE
    setup = f"locks={shlex.quote(str(locks))}; g=0; me=$(id -u); now=$(date +%s); ttl=3600; "
    subprocess.run(["sh", "-c", setup + claim], check=True)
    writer = _sh_loop(setup + claim, tmp_path)
    looks: list[leases.Leases] = []
    while writer.poll() is None:
        argv = ["sh", "-c", leases._PROBE, "lease-probe", str(locks), "0", str(tmp_path), "60", "0"]
        done = subprocess.run(argv, capture_output=True, text=True)
        looks.append(leases.parse_probe(done.returncode, done.stdout, done.stderr))
    wrong = [look for look in looks if look.free or look.reserved != 1]
    assert not wrong, f"{len(wrong)} of {len(looks)} probes read the claim half written and called GPU 0 free"
    assert sorted(p.name for p in locks.iterdir() if "reserved" in p.name) == [f"gpu0.{leases.RESERVED}.{os.getuid()}"]
