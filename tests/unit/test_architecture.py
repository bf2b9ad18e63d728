"""The layout the architecture doc describes, held by the code: the rooms are subpackages, and
what each may import at load time is stated here once (ALLOWED) and checked on every module.

- core/: the pure decisions and nouns: imports only itself and the config's types, and no
  module of the standard library that does I/O;
- services/: the services over the store: no backend, no daemon, no front end;
- daemon/: the daemon's edge; nothing imports it but the CLI;
- backends/: the kernel and the hardware: no service, no daemon;
- replay/: the daemon's services on a virtual clock: no backend, no daemon;
- fleet/, web/, cli/: several servers, the web view, the command line.

No import cycle anywhere; gpuguard/ itself keeps at most a dozen modules.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

import gpuguard

PACKAGE = Path(gpuguard.__file__).parent
ROOMS = ("core", "services", "daemon", "backends", "replay", "fleet", "web", "cli")
TOP = "top"  # the modules of gpuguard/ itself: the config, the wire format and its clients, the logs

# What each room may import when its modules load (TYPE_CHECKING imports and imports inside
# functions are not counted: those load nothing at start). Its own room is always allowed.
ALLOWED: dict[str, set[str]] = {
    "core": {"gpuguard.config"},
    "services": {"core", TOP, "fleet"},
    "daemon": {"core", TOP, "services", "backends", "fleet"},
    "backends": {"core", TOP},
    "replay": {"core", TOP, "services"},
    "fleet": {"core", TOP, "services"},
    "web": {"core", TOP, "backends"},
    "cli": {"core", TOP, "services", "daemon", "backends", "replay", "fleet", "web"},
    TOP: {"core", "backends"},
}
ENTRY = {"gpuguard.__main__": {"gpuguard.cli"}}  # `python -m gpuguard` is the command line
# The standard library modules that touch files, processes, sockets or threads: none in the core.
DOES_IO = {"os", "subprocess", "socket", "sqlite3", "asyncio", "threading", "shutil", "select", "fcntl",
           "signal", "ctypes", "tempfile", "concurrent"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _load_time_nodes(tree: ast.Module) -> list[ast.AST]:
    """The statements that run when the module loads: not under `if TYPE_CHECKING`, not in functions."""
    found: list[ast.AST] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        found += [node] if not isinstance(node, (ast.If, ast.Try)) else list(ast.walk(node))
    return found


def runtime_imports(path: Path) -> set[str]:
    """gpuguard modules imported when the module loads (not inside functions, not for type checking)."""
    found: set[str] = set()
    for child in _load_time_nodes(ast.parse(path.read_text())):
        if isinstance(child, ast.Import):
            found |= {a.name for a in child.names if a.name.startswith("gpuguard")}
        elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("gpuguard"):
            base = child.module
            found |= {f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in child.names}
    return found


def stdlib_imports(path: Path) -> set[str]:
    """The top-level names of the non-gpuguard modules imported when the module loads."""
    found: set[str] = set()
    for child in _load_time_nodes(ast.parse(path.read_text())):
        if isinstance(child, ast.Import):
            found |= {a.name.split(".")[0] for a in child.names}
        elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
            found.add(child.module.split(".")[0])
    return found - {"gpuguard", "__future__"}


@cache
def paths() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


@cache
def graph() -> dict[str, set[str]]:
    modules = paths()
    return {name: {i for i in runtime_imports(path) if i in modules and i != name} for name, path in modules.items()}


def room(module: str) -> str:
    """The room a module is in: its subpackage, or TOP for gpuguard/'s own modules."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ROOMS:
        return parts[1]
    return TOP


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


def test_every_module_is_in_a_room_with_a_rule():
    assert {room(name) for name in paths()} <= set(ALLOWED)


@pytest.mark.parametrize("name", sorted(graph()))
def test_each_module_imports_only_what_its_room_may(name):
    mine = room(name)
    allowed = ALLOWED[mine] | {mine} | ENTRY.get(name, set())
    wrong = {i for i in graph()[name] if room(i) not in allowed and i not in allowed}
    assert wrong == set(), f"{name} ({mine}) imports {sorted(wrong)}"


def test_nothing_but_the_command_line_imports_the_daemon():
    importers = {name for name, imports in graph().items() if room(name) != "daemon"
                 and any(room(i) == "daemon" for i in imports)}
    assert importers <= {"gpuguard.cli.daemon_cmd"}, importers


def test_the_core_does_no_io():
    for name, path in paths().items():
        if room(name) == "core":
            assert not stdlib_imports(path) & DOES_IO, (name, stdlib_imports(path) & DOES_IO)


def test_gpuguard_itself_keeps_at_most_a_dozen_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


def reached(name: str) -> set[str]:
    """Every gpuguard module `name` imports when it loads, through any chain of imports."""
    edges, todo = graph(), [name]
    seen: set[str] = set()
    while todo:
        for nxt in edges[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize("name", ["gpuguard.config", "gpuguard.core", *sorted(n for n in paths() if room(n) == "core")])
def test_the_core_and_the_config_reach_nothing_under_backends(name):
    assert {m for m in reached(name) if room(m) == "backends"} == set()
