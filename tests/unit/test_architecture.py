"""The layout the README describes, held by the code: no import cycle, nothing reaches into the
daemon, the pure core imports no module that does I/O, and nothing under backends/ (the kernel
and the hardware) is reached from the pure core or the config, even through another module."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpuguard

PACKAGE = Path(gpuguard.__file__).parent
PURE = {"model", "units", "errors", "compat", "policy", "allocator", "rules", "scheduler", "messages", "escape",
        "reporting", "layout", "mig_profiles", "config_warnings", "doctor", "gres", "coexist", "requests"}
DOES_IO = {"store", "daemon", "server", "api", "watcher", "sampling", "grants", "holders", "logout", "metrics",
           "queueing", "lookups", "exempt", "client", "pam_hook", "quota_file", "replay", "backends"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> set[str]:
    """gpuguard modules imported when the module loads (not inside functions, not for type checking)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in [node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node):
            if isinstance(child, ast.Import):
                found |= {a.name for a in child.names if a.name.startswith("gpuguard")}
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("gpuguard"):
                base = child.module
                found |= {f"{base}.{a.name}" if (PACKAGE.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(
                    ".py").exists() else base for a in child.names}
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {i for i in runtime_imports(path) if i in modules and i != name} for name, path in modules.items()}


def test_the_import_graph_has_no_cycle():
    edges, state, cycles = graph(), {}, []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_only_the_daemon_command_imports_the_daemon():
    importers = {name for name, imports in graph().items() if "gpuguard.daemon" in imports}
    assert importers <= {"gpuguard.cli.daemon_cmd"}


def test_the_pure_core_imports_nothing_that_does_io():
    edges = graph()
    for name in PURE:
        reached = {i.split(".")[1] for i in edges[f"gpuguard.{name}"]}
        assert not reached & DOES_IO, (name, reached & DOES_IO)


def reached(name: str) -> set[str]:
    """Every gpuguard module `name` imports when it loads, through any chain of imports."""
    edges, todo = graph(), [name]
    seen: set[str] = set()
    while todo:
        for nxt in edges[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def under_backends(modules: set[str]) -> set[str]:
    return {m for m in modules if m == "gpuguard.backends" or m.startswith("gpuguard.backends.")}


@pytest.mark.parametrize("name", sorted(PURE | {"config"}))
def test_the_pure_core_and_the_config_reach_nothing_under_backends(name):
    assert under_backends(reached(f"gpuguard.{name}")) == set()


def test_the_replay_imports_nothing_under_backends():
    """Its own imports: the services it drives (the watcher, the sampler's types) reach the backends'
    types, but what touches the kernel comes to the replay only as the wiring's edges."""
    assert under_backends(graph()["gpuguard.replay"]) == set()
