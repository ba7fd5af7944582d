"""Preflight: check the host before anything is copied or started there, and say what is missing."""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any

from orchestrator.config.paths import PROJECT_ROOT
from orchestrator.config.settings import HostConfig
from orchestrator.host.transport import CommandResult, Transport

REQUIRED = ("torch", "transformers", "safetensors", "numpy")
MIN_FREE_GIB = 1.0
SCRIPT = PROJECT_ROOT / "remote_worker" / "preflight.py"
MIN_PYTHON = (3, 10)
_NEEDS_PYTHON = f"the worker needs Python >= {'.'.join(map(str, MIN_PYTHON))}"
# Under this much free space the work dir counts as full (the worker could not even write its traceback).
FULL_KIB = 1024


class PreflightFailed(RuntimeError):
    """The host lacks something the run needs; the message names the host and the missing piece."""


def checkpoint_paths(model: dict[str, Any]) -> dict[str, str]:
    """The directories the run will load from on the host, by what they are for."""
    paths = {}
    if model["source"] == "pretrained":
        paths["model.path"] = str(model["path"])
    draft = model.get("draft") or {}
    if draft.get("source") == "pretrained":
        paths["model.draft.path"] = str(draft["path"])
    # A relative path names a fixture shipped inside the worker's package: it travels with the code.
    return {key: path for key, path in paths.items() if path.startswith("/")}


def run_preflight(transport: Transport, host: HostConfig, model: dict[str, Any], python: str) -> dict[str, Any]:
    name = host.name
    paths = checkpoint_paths(model)
    argv = [python, "-c", SCRIPT.read_text(encoding="utf-8"), "--workdir", host.workdir]
    result = transport.run([*argv, *(f"{key}={path}" for key, path in paths.items())], check=False)
    report = _report(result.stdout) if result.ok else None
    if report is None:
        raise PreflightFailed(f"{name}: {_interpreter_problem(transport, python, result)}")
    if _version_tuple(report.get("python")) < MIN_PYTHON:
        raise PreflightFailed(f"{name}: host.python {python} is Python {report['python']}; {_NEEDS_PYTHON}")
    missing = [module for module in REQUIRED if not report.get(module)]
    if missing:
        raise PreflightFailed(
            f"{name}: {python} cannot import {', '.join(missing)} (the worker needs {', '.join(REQUIRED)})"
        )
    for key, present in report["paths"].items():
        if not present:
            raise PreflightFailed(f"{name}: {key} {paths[key]} is missing or has no config.json")
    if report.get("workdir_problem"):
        raise PreflightFailed(f"{name}: {_workdir_words(host.workdir, report)}")
    if report["workdir_free_gib"] < MIN_FREE_GIB:
        raise PreflightFailed(
            f"{name}: host.workdir {host.workdir}: no space left "
            f"({report['workdir_free_gib']} GiB free, at least {MIN_FREE_GIB} GiB needed)"
        )
    if model["device"] == "cuda" and not report["gpus"]:
        raise PreflightFailed(f"{name}: model.device=cuda but torch sees no GPU there (CUDA {report['cuda']})")
    if lease_candidates(host, report) and not report.get("flock"):
        raise PreflightFailed(f"{name}: GPU leases need the flock command (util-linux) on the host")
    return report


def lease_candidates(host: HostConfig, report: dict[str, Any]) -> list[int]:
    """The GPUs a run may lease: host.gpus, with `auto` meaning every GPU the preflight saw."""
    gpus = host.gpus
    if gpus == "auto":
        return [int(g["index"]) for g in report["gpus"]]
    return [] if gpus == "none" else [int(g) for g in gpus]


# -- what went wrong, in the words of the host's settings --------------------------------------------------


def _report(stdout: str) -> dict[str, Any] | None:
    """The preflight's JSON report: its last line of output; None when that is not one."""
    lines = stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return report if isinstance(report, dict) and isinstance(report.get("paths"), dict) else None


def _first_line(text: str, limit: int = 120) -> str | None:
    for line in text.splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return None


def _version_tuple(version: object) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)", str(version or ""))
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _interpreter_problem(transport: Transport, python: str, result: CommandResult) -> str:
    """Why `host.python` gave no preflight report: missing, not executable, too old, not a Python, or broken."""
    if result.exit_code == 127:
        return f"the interpreter {python} does not exist there (host.python)"
    if result.exit_code == 126:
        return f"the interpreter {python} cannot be executed there (host.python): {_last_line(result.stderr)}"
    if "SyntaxError" in result.stderr:  # an interpreter too old to parse the check
        version = _python_version(transport, python)
        if version is not None and _version_tuple(version) < MIN_PYTHON:
            return f"host.python {python} is Python {version}; {_NEEDS_PYTHON}"
        return f"host.python {python} could not run the preflight check: {_last_line(result.stderr)} ({_NEEDS_PYTHON})"
    if not result.ok and "Traceback" in result.stderr:  # a Python, but a broken one
        return f"host.python {python} could not run the preflight check: {_last_line(result.stderr)}"
    said = _first_line(result.stdout) or _first_line(result.stderr) or "no output"
    return f"host.python {python} is not a Python interpreter (it did not run the preflight check: {said})"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _python_version(transport: Transport, python: str) -> str | None:
    """`python -V` (which Python 2 prints on stderr); None when it says no version."""
    result = transport.run([python, "-V"], check=False)
    match = re.search(r"Python (\d+\.\d+(?:\.\d+)?)", f"{result.stdout}\n{result.stderr}")
    return match[1] if match else None


def _where(workdir: str, checked: str) -> str:
    """Nothing when `checked` is the work dir itself; else the ancestor it will be created in."""
    if not workdir.startswith("/") or posixpath.normpath(checked) == posixpath.normpath(workdir):
        return ""
    return f" ({checked}, where it would be created)"


def _workdir_words(workdir: str, report: dict[str, Any]) -> str:
    problem, checked = report["workdir_problem"], report.get("workdir_checked") or workdir
    if problem == "not a directory":
        return f"host.workdir {workdir}: {checked} is not a directory"
    return f"host.workdir {workdir}: {problem}{_where(workdir, checked)}"


# A fixed script, values as positional arguments: $1 the work dir, $2 the host's Python (may be empty).
# It only looks: the nearest existing folder, its free space and inodes (POSIX df), whether it is writable
# (test -w asks access(2), false on a read-only mount even for root), and, with a Python, whether the
# file system is mounted read-only.
_DIAGNOSE = (
    'd=$1; while [ ! -e "$d" ]; do d=$(dirname -- "$d"); done; echo "checked $d"; '
    '[ -d "$d" ] || { echo notdir; exit 0; }; '
    'df -Pk -- "$d" 2>/dev/null | awk \'NR==2 {print "free_kib " $4}\'; '
    'df -Pi -- "$d" 2>/dev/null | awk \'NR==2 {print "inodes " $2 " " $4}\'; '
    'if [ -w "$d" ] && [ -x "$d" ]; then echo writable; exit 0; fi; '
    '[ -n "$2" ] && "$2" -c "import os, sys; '
    "print('readonly' if os.statvfs(sys.argv[1]).f_flag & getattr(os, 'ST_RDONLY', 1) else 'readwrite')\" "
    '"$d" 2>/dev/null; echo notwritable'
)


def workdir_problem(transport: Transport, workdir: str, python: str | None = None) -> str | None:
    """What is wrong with `host.workdir` on the host now, in one line naming it; None when nothing is seen.

    For naming the cause after the fact, e.g. of a worker that died without reporting (a full disk leaves it
    unable to write even its traceback): "host.workdir /x: no space left (12 KiB free)", "host.workdir /x:
    no inodes left", "host.workdir /x: read-only file system", "host.workdir /x: not writable". `python`,
    the host's interpreter, only tells a read-only mount from a refused permission. A command that fails
    gives None; a lost connection raises as the transport does.
    """
    result = transport.run(["sh", "-c", _DIAGNOSE, "workdir-check", workdir, python or ""], check=False)
    return _parse_workdir_answer(workdir, result.stdout)


def _parse_workdir_answer(workdir: str, text: str) -> str | None:
    """The problem `_DIAGNOSE`'s output shows, if any (see `workdir_problem`)."""
    answer: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        answer[key] = value
    checked = answer.get("checked", workdir)
    where = _where(workdir, checked)
    if "notdir" in answer:
        return f"host.workdir {workdir}: {checked} is not a directory"
    if "notwritable" in answer:
        problem = "read-only file system" if "readonly" in answer else "not writable"
        return f"host.workdir {workdir}: {problem}{where}"
    free = answer.get("free_kib", "")
    if free.isdigit() and int(free) < FULL_KIB:
        return f"host.workdir {workdir}: no space left ({int(free)} KiB free){where}"
    total, _, inodes_free = answer.get("inodes", "").partition(" ")
    if total.isdigit() and int(total) > 0 and inodes_free.isdigit() and int(inodes_free) == 0:
        return f"host.workdir {workdir}: no inodes left (no file can be created){where}"
    return None
