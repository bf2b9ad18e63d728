"""Opening device nodes as a test user, and nodes that only the gate can refuse.

    report = probe(alice, [path, ...])          # gate_probe.py's JSON report (uid, pid, cgroup, results)
    opens(alice, {key: path, ...})              # {key: "ok" | errno name}
    open_result(alice, path)                    # "ok" | errno name
    with holding(alice, path) as holder: ...    # a process of alice's holding path open
    bare_nodes(directory, minors)               # 0666 nvidia<minor> nodes: file permissions never refuse

What the kernel answers, without an NVIDIA driver: ENXIO = the open got through to the (absent)
driver, EPERM = the gate refused it, EACCES = file permissions (mode, ACL) refused it.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from subprocess import PIPE
from typing import TYPE_CHECKING, TypeVar

from conftest import PYTHON, popen_as, run_as

from gpuguard.core.model import NVIDIA_MAJOR

if TYPE_CHECKING:
    from conftest import TestUser

PROBE = str(Path(__file__).with_name("gate_probe.py"))
ALLOWED, GATE_DENIED, FILE_DENIED = "ENXIO", "EPERM", "EACCES"
K = TypeVar("K")


def probe_argv(*args: str) -> list[str]:
    """argv running gate_probe.py (standard library only, so `-I -S`)."""
    return [PYTHON, "-I", "-S", PROBE, *args]


def probe(user: TestUser, paths: Iterable[str | os.PathLike], *flags: str, wrap: tuple[str, ...] = ()) -> dict:
    """Open each path as the user (flags: --detach; wrap: a command to run the probe under)."""
    proc = run_as(user, [*wrap, *probe_argv(*flags, *map(str, paths))])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def opens(user: TestUser, paths: Mapping[K, str | os.PathLike], *flags: str,
          wrap: tuple[str, ...] = ()) -> dict[K, str]:
    """What opening each path gave the user, by the same keys."""
    results = probe(user, paths.values(), *flags, wrap=wrap)["results"]
    return {key: results[str(path)] for key, path in paths.items()}


def open_result(user: TestUser, path: str | os.PathLike) -> str:
    return opens(user, {0: path})[0]


@contextmanager
def holding(user: TestUser, path: str | os.PathLike, timeout: float = 60) -> Iterator[subprocess.Popen]:
    """A process of the user's that holds path open for the block (it is killed if it will not end)."""
    holder = popen_as(user, probe_argv("--hold", str(path)), stdin=PIPE, stdout=PIPE, stderr=PIPE, text=True)
    try:
        line = holder.stdout.readline().strip()
        assert line == "held", f"the holder could not open {path}: {line!r} {holder.stderr.read() if not line else ''}"
        yield holder
    finally:
        holder.stdin.close()  # it closes the node and exits
        try:
            holder.wait(timeout)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        holder.stdout.close()
        holder.stderr.close()


def open_node(path: Path, dev: tuple[int, int]) -> Path:
    """A 0666 root-owned character node for dev at path (made unless it is there already)."""
    if not path.exists():
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*dev))
        os.chmod(path, 0o666)  # past the umask
    return path


def fresh_node(path: Path, dev: tuple[int, int]) -> Path:
    """Put a fresh 0666 root-owned node for dev in place of the one at path, as nvidia-modprobe
    makes one (no ACL, no uevent). Renamed over it: removing it first left a moment in which the
    daemon's own repair could make it again, and the mknod then found it there."""
    made = open_node(path.with_name(f".{path.name}.fresh"), dev)
    os.replace(made, path)
    return path


def bare_nodes(directory: Path, minors: Iterable[int], major: int = NVIDIA_MAJOR) -> dict[int, Path]:
    """0666 nodes `directory/nvidia<minor>` (the directory made 0755 if need be): file permissions
    let everyone in, so only the gate can say no."""
    directory.mkdir(mode=0o755, exist_ok=True)
    return {minor: open_node(directory / f"nvidia{minor}", (major, minor)) for minor in minors}
