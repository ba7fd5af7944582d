"""The orchestrator's folders are its architecture: layers that import one way, no circles, one transport hook.

Read from the source with `ast` (every import, including those inside functions and under TYPE_CHECKING), so
a lazy import cannot hide an upward arrow. The layers, outer to inner, and what each may import:

    cli → lifecycle → sweep → stream → {tracking, host} → config

`tracking` and `host` are peers: neither imports the other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "orchestrator"

# What each layer may import besides itself (the order of the package docstring in orchestrator/__init__.py).
ALLOWED = {
    "cli": {"lifecycle", "sweep", "stream", "tracking", "host", "config"},
    "lifecycle": {"sweep", "stream", "tracking", "host", "config"},
    "sweep": {"stream", "tracking", "host", "config"},
    "stream": {"tracking", "host", "config"},
    "tracking": {"config"},
    "host": {"config"},
    "config": set(),
}
# The concrete transports, and the one module that may pick between them.
CONCRETE = {"orchestrator.host.local", "orchestrator.host.ssh"}
HOOK = "orchestrator.host.connect"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """The orchestrator modules `path` imports, with the line of each import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from orchestrator.host import sync` imports the module orchestrator.host.sync
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name:
                yield target, node.lineno


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {name: dict(imports_of(name, path, set(known))) for name, path in known.items()}


def layer(name: str) -> str | None:
    """`orchestrator.host.ssh` → `host`; None for the package root and `__main__`."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def test_every_module_belongs_to_a_layer() -> None:
    roots = ("orchestrator", "orchestrator.__main__")
    loose = [name for name in modules() if layer(name) is None and name not in roots]
    assert not loose, f"modules outside the layers (put each in one of {sorted(ALLOWED)}): {loose}"


def test_imports_run_one_way_outer_to_inner() -> None:
    upward = []
    for name, targets in graph().items():
        source = layer(name)
        for target, line in targets.items():
            if target == "orchestrator":
                upward.append(f"{name}:{line} imports the package root (use orchestrator.config.paths)")
                continue
            goal = layer(target)
            if source is None or goal is None or goal == source:
                continue
            if goal not in ALLOWED[source]:
                upward.append(f"{name}:{line} ({source}) imports {target} ({goal})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """A circle of imports, as the list of its modules (the first one repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_module_imports_itself_round_a_circle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " → ".join(cycle or [])


def test_no_layer_imports_another_round_a_circle() -> None:
    layers: dict[str, dict[str, int]] = {}
    for name, targets in graph().items():
        source = layer(name)
        if source is None:
            continue
        for target in targets:
            goal = layer(target)
            if goal is not None and goal != source:
                layers.setdefault(source, {})[goal] = 0
    cycle = find_cycle(layers)
    assert cycle is None, "layers in a circle: " + " → ".join(cycle or [])


def test_only_the_hook_imports_a_concrete_transport() -> None:
    """Everything else holds a `Transport` and never asks which kind it is (fabric's `Remote` overrides hooks)."""
    offenders = [
        f"{name}:{line} imports {target}"
        for name, targets in graph().items()
        for target, line in targets.items()
        if target in CONCRETE and name != HOOK
    ]
    assert not offenders, f"concrete transports imported outside {HOOK}: {offenders}"


# The heavy libraries each orchestrator process would pay for on start: torch and transformers' model machinery
# (about 5 s of CPU), matplotlib (0.7 s). Every command imports the whole package's graph; they are imported
# where they are used (a figure drawn, the paper's intervals, a tokenizer that is not plain).
HEAVY = ("torch", "transformers", "matplotlib")


def test_importing_every_orchestrator_module_imports_no_heavy_library() -> None:
    names = sorted(name for name in modules() if not name.endswith("__main__"))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"    assert not (heavy := [k for k in {HEAVY!r} if k in sys.modules]), (name, heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


# -- the checks themselves fail where they must ---------------------------------------------------------------


def test_the_cycle_finder_finds_a_circle_and_passes_a_tree() -> None:
    assert find_cycle({"a": {"b": 0}, "b": {"c": 0}, "c": {"a": 0}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 0, "c": 0}, "b": {"c": 0}, "c": {}}) is None


@pytest.mark.parametrize(
    ("source", "line", "target"),
    [
        ("orchestrator/config/x.py", "from orchestrator.host.launch import SPEC_FILE", "orchestrator.host.launch"),
        ("orchestrator/host/x.py", "from orchestrator.host import ssh", "orchestrator.host.ssh"),
        ("orchestrator/host/x.py", "    from .ssh import SSHTransport", "orchestrator.host.ssh"),
        ("orchestrator/stream/x.py", "import orchestrator.lifecycle.job", "orchestrator.lifecycle.job"),
    ],
)
def test_every_form_of_import_is_read(tmp_path: Path, source: str, line: str, target: str) -> None:
    path = ROOT / source
    fake = tmp_path / "x.py"
    fake.write_text(("def f():\n" + line + "\n") if line.startswith(" ") else line + "\n")
    known = set(modules()) | {module_name(path)}
    name = module_name(path)
    found = dict(imports_of(name, fake, known))
    assert target in found, found
