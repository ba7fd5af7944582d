"""The compile cache runs what it holds, so only the user may write it: private by default, checked whole before
each use, refused (with one line, and a cold compile in the run's scratch folder) when anything in it could
have been written by someone else, when it is read-only or full; shared only with a group the user names."""

from __future__ import annotations

import errno
import grp
import logging
import os
import pickle
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from remote_worker.decoding import compile_cache
from remote_worker.decoding.compile_cache import CompileCache, cache_root

pytestmark = pytest.mark.worker
ROOT = os.geteuid() == 0
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def new_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "work" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    return run_dir


def switches() -> tuple[bool, bool]:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache


def opened(run_dir: Path, enabled: bool = True, group: str | None = None) -> tuple[CompileCache, str, tuple]:
    """The cache as a run opens it, where its compiles would go (TORCHINDUCTOR_CACHE_DIR inside), and torch's
    cache switches inside; the process's own folder and switches are back afterwards."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), switches()
    try:
        with CompileCache.open(run_dir, enabled, group) as cache:  # the folder the compiles reach, by its name
            return cache, os.path.realpath(os.environ["TORCHINDUCTOR_CACHE_DIR"]), switches()
    finally:
        assert (os.environ.get("TORCHINDUCTOR_CACHE_DIR"), switches()) == before


def test_the_cache_is_private_by_default_and_written_under_umask_077(tmp_path: Path) -> None:
    run_dir = new_run(tmp_path)
    cache, where, _ = opened(run_dir)
    root = cache_root(run_dir)
    assert where == str(root / "inductor") and cache.enabled and cache.outcome() == "miss"
    assert root.name.startswith("compile-cache.") and stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "inductor").stat().st_mode) == 0o700
    assert os.umask(0o022) == 0o022 and os.umask(0o022) == 0o022, "the process's umask comes back"


def test_off_compiles_in_the_runs_scratch_folder(tmp_path: Path) -> None:
    run_dir = new_run(tmp_path)
    cache, where, inside = opened(run_dir, enabled=False)
    assert where == str(run_dir / compile_cache.SCRATCH) and cache.outcome() == "off"
    assert inside == (False, False) and not cache_root(run_dir).exists()


@pytest.mark.parametrize("planted", ["group-writable folder", "other-writable file", "link", "foreign owner"])
def test_a_cache_another_user_could_have_written_is_refused_with_its_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, planted: str
) -> None:
    run_dir = new_run(tmp_path)
    opened(run_dir)
    root = cache_root(run_dir)
    entry = root / "inductor" / "ab" / "cab.py"
    entry.parent.mkdir(mode=0o700)
    entry.write_text("print('planted')\n")
    entry.chmod(0o600)
    if planted == "group-writable folder":
        root.chmod(0o2775)
        expected = f"{root} is writable by its group (mode 2775)"
    elif planted == "other-writable file":
        entry.chmod(0o666)
        expected = f"{entry} is writable by every user (mode 0666)"
    elif planted == "link":
        entry.unlink()
        entry.symlink_to(tmp_path / "elsewhere.py")
        expected = f"{entry} is a symbolic link"
    else:
        if not ROOT:
            pytest.skip("giving a file to another user needs root")
        os.chown(entry, 65534, 65534)
        expected = f"{entry} is owned by uid 65534, not by you (uid {os.geteuid()})"
    with caplog.at_level(logging.WARNING, logger="remote_worker.decoding.compile_cache"):
        cache, where, _ = opened(run_dir)
    assert where == str(run_dir / compile_cache.SCRATCH) and cache.outcome() == "refused"
    assert [r.getMessage() for r in caplog.records] == [
        f"compile cache not used: {expected}; compiling in the run's scratch folder "
        "(decode.compile_cache=false silences this)"
    ]


@pytest.mark.parametrize(
    ("code", "cause"), [(errno.EROFS, "read-only file system"), (errno.ENOSPC, "no space left on the device")]
)
def test_a_read_only_or_full_cache_falls_back_to_a_cold_compile_and_names_the_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, code: int, cause: str
) -> None:
    run_dir = new_run(tmp_path)
    opened(run_dir)

    def refused(*_args, **_kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(compile_cache.tempfile, "NamedTemporaryFile", refused)  # what a write there meets
    with caplog.at_level(logging.WARNING, logger="remote_worker.decoding.compile_cache"):
        cache, where, _ = opened(run_dir)
    assert where == str(run_dir / compile_cache.SCRATCH) and cache.outcome() == "refused"
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(
            f"compile cache not used: {cache_root(run_dir) / 'inductor'} cannot be written: {cause}; compiling in"
        )
    )


def test_a_compile_that_failed_for_lack_of_space_says_so(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path, enabled=True)
    problem = cache.space_problem("OSError: [Errno 28] No space left on device: '/w/compile-cache.u/x.so'")
    assert problem is not None and problem.startswith(f"no space left for the compile in {tmp_path} (")
    assert cache.space_problem("CppCompileError: C++ compile error") is None  # this disk has room


def test_a_cache_shared_with_a_named_group_is_that_groups(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getegid()).gr_name
    run_dir = new_run(tmp_path)
    cache, where, _ = opened(run_dir, group=group)
    root = cache_root(run_dir, group)
    assert root.name == f"compile-cache.group-{group}" and cache.enabled and where == str(root / "inductor")
    assert stat.S_IMODE(root.stat().st_mode) == 0o2770 and root.stat().st_gid == os.getegid()
    (root / "inductor" / "x.py").write_text("")
    (root / "inductor" / "x.py").chmod(0o664)  # a member's entry, group-writable: what sharing means
    assert opened(run_dir, group=group)[0].enabled
    (root / "inductor" / "x.py").chmod(0o666)  # writable by everyone: never
    assert opened(run_dir, group=group)[0].outcome() == "refused"
    with pytest.raises(Exception, match="no such group"):
        compile_cache.prepare(run_dir, "no-such-group-here")


_COMPILE = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from remote_worker.decoding.compile_cache import CompileCache

    with CompileCache.open(Path(sys.argv[1]), True) as cache:
        compiled = torch.compile(lambda x: (x * 2 + 1).sin())
        compiled(torch.ones(8))
    print(cache.outcome())
    """
)


# The same compile with a hook between the check and the use: inside `open` (the cache checked), the folder's
# name is given to a planted copy, as another user who may write the work folder could do (no timing race).
_SWAPPED_COMPILE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path

    import torch

    from remote_worker.decoding.compile_cache import CompileCache, cache_root

    run_dir, planted = Path(sys.argv[1]), Path(sys.argv[2])
    root = cache_root(run_dir)
    with CompileCache.open(run_dir, True) as cache:
        os.rename(root, root.with_name("checked"))
        os.rename(planted, root)
        compiled = torch.compile(lambda x: (x * 2 + 1).sin())
        compiled(torch.ones(8))
    print(cache.outcome())
    """
)


class _Planted:
    """A pickle that writes a file when it is loaded (what a replaced cache entry could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "a planted pickle ran"))


def _plant(root: Path, module_marker: Path, pickle_marker: Path) -> None:
    """Every cached module of `root` made to write `module_marker` when imported, every FX-graph entry replaced by
    a pickle that writes `pickle_marker` when loaded."""
    modules = list(root.rglob("*.py"))
    entries = [p for p in (root / "inductor" / "fxgraph").rglob("*") if p.is_file()]
    assert modules and entries
    for module in modules:
        module.write_text(
            module.read_text() + f"\nfrom pathlib import Path\nPath({str(module_marker)!r}).write_text('x')\n"
        )
    for entry in entries:
        entry.write_bytes(pickle.dumps(_Planted(pickle_marker)))


@pytest.mark.slow
def test_a_planted_module_and_pickle_in_a_cache_others_can_write_are_never_loaded(tmp_path: Path) -> None:
    """A real inductor compile (a small function, in fresh processes): once a cache entry's module and pickle
    are replaced and the folder made group-writable, the next compile refuses the cache and neither runs;
    made private again, the same entries do run, which shows the refusal was what kept them out."""
    run_dir = new_run(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}

    def compile_once() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _COMPILE, str(run_dir)], env=env, capture_output=True,
                              text=True, timeout=600, check=False)  # fmt: skip

    first = compile_once()
    assert first.returncode == 0 and first.stdout.split()[-1] == "miss", first.stderr[-2000:]
    root = cache_root(run_dir)

    # A planted copy that passes every check (private, the user's own) put in the folder's place after the
    # check: the compile still reads the folder it checked, by its handle, and nothing planted runs.
    planted = tmp_path / "planted"
    shutil.copytree(root, planted, symlinks=True)
    swap_marker = tmp_path / "swapped-in-ran"
    _plant(planted, swap_marker, swap_marker)
    swapped = subprocess.run([sys.executable, "-c", _SWAPPED_COMPILE, str(run_dir), str(planted)], env=env,
                             capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert swapped.returncode == 0 and swapped.stdout.split()[-1] == "hit", swapped.stderr[-2000:]
    assert not swap_marker.exists(), "a planted copy swapped in after the check ran"
    shutil.rmtree(root)  # the planted copy, now under the folder's name; the checked folder back
    os.rename(root.with_name("checked"), root)

    module_marker, pickle_marker = tmp_path / "module-ran", tmp_path / "pickle-ran"
    _plant(root, module_marker, pickle_marker)
    root.chmod(0o2775)

    refused = compile_once()
    assert refused.returncode == 0 and refused.stdout.split()[-1] == "refused", refused.stderr[-2000:]
    assert "is writable by its group" in refused.stderr
    assert not module_marker.exists() and not pickle_marker.exists()

    root.chmod(0o700)  # the same planted entries in a folder that passes the check: they run
    control = compile_once()  # (the planted pickle is no graph: the compile itself may then fail)
    assert module_marker.exists() or pickle_marker.exists(), control.stderr[-2000:]


def test_a_cache_that_fills_up_during_the_compile_is_left_for_a_cold_compile_in_private_temporary_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache's disk full in the middle of a compile: the run compiles once more, cold, in a folder of its own
    in the system's temporary space, and says so; it decodes eagerly only where that fails too."""
    from types import SimpleNamespace

    from remote_worker.events import EventLog
    from remote_worker.experiments import ddtree_gdn

    run_dir = new_run(tmp_path)
    monkeypatch.setattr(ddtree_gdn.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    compiled = object()
    where: list[str] = []

    def compile_rounds(*_args: object) -> object:
        where.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return "OSError: [Errno 28] No space left on device: 'x.so'" if len(where) == 1 else compiled

    monkeypatch.setattr(ddtree_gdn, "compile_rounds", compile_rounds)
    monkeypatch.setattr(ddtree_gdn, "wanted", lambda setting, device: True)
    spec = SimpleNamespace(decode={"compile": True}, run_dir=run_dir)
    settings = SimpleNamespace(max_new_tokens=8, temperature=0.0)
    with caplog.at_level(logging.WARNING, logger="remote_worker.experiments.ddtree_gdn"):
        got = ddtree_gdn._compiled_rounds(spec, EventLog(run_dir), SimpleNamespace(device="cpu"), None, [], [None],
                                          settings, 16, {})  # fmt: skip
    assert got is compiled
    scratch = Path(where[1]).parent
    assert where[0].endswith("/inductor") and where[1] == str(scratch / compile_cache.SCRATCH)  # the cache, then
    assert scratch.parent == tmp_path / "tmp"  # the system's temporary space
    assert stat.S_IMODE(scratch.stat().st_mode) == 0o700  # private: its kernels run in the worker
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(f"decode.compile: no space left for the compile in {cache_root(run_dir)}")
    )
    assert caplog.records[0].getMessage().endswith(f"; compiling cold in {scratch} instead")
