"""What the demo, the tests and the bench share to run gpuguard from this checkout: a daemon with
a gate of its own, one gate-attaching run at a time on the machine, a checkout other users can
reach, bpffs left as found, and a user's processes ended. Not part of the installed package
(see devtools/__init__.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

import psutil

from gpuguard import client
from gpuguard import config as configuration
from gpuguard.backends.gate import PIN_ROOT, Gate
from gpuguard.backends.mounts import BPFFS, bpffs_mounted, cgroup2_root, unmount_bpffs

VENV_BIN = Path(sys.executable).parent  # the venv's scripts (`gpuguard`), wherever the Makefile's VENV put it
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 20.0, step: float = 0.05) -> T:
    """Poll until `predicate` returns something truthy, and return it (its last value after
    `timeout`). A bound on waiting for what a daemon or a process does, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(step)
    return predicate()


@contextmanager
def _cgroup_root_locked(mode: int) -> Iterator[None]:
    fd = os.open(cgroup2_root(), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


def gate_test_lock() -> contextlib.AbstractContextManager[None]:
    """Held (exclusively) by every test, demo or bench that attaches a gate, for as long as it is
    attached: two attached gates would both have to allow every open, so a run seeing another
    run's gate (several people testing on one machine) fails with EPERM where it expects ENXIO.
    A flock on the cgroup v2 root directory, which every gate shares and which leaves no file."""
    return _cgroup_root_locked(fcntl.LOCK_EX)


def no_gate_attached() -> contextlib.AbstractContextManager[None]:
    """Keep gate-attaching runs waiting while test users open simulated nodes without a daemon:
    a gate attached by any run on this machine would deny them (EPERM). Shared, so such tests
    still run in parallel with each other. Never use it inside gate_test_lock: the same process
    would wait for itself."""
    return _cgroup_root_locked(fcntl.LOCK_SH)


def start_daemon(stack: ExitStack, config: Path, gate: str, log: Path | None = None) -> subprocess.Popen:
    """`gpuguard daemon` with a gate of its own, once it answers on its socket (the demo's and the
    bench's). Closing the stack stops it, detaches its gate and lets other gates be attached."""
    stack.enter_context(gate_test_lock())
    out = stack.enter_context(open(log, "wb")) if log else subprocess.DEVNULL
    daemon = subprocess.Popen([str(VENV_BIN / "gpuguard"), "--config", str(config), "daemon", "--gate-name", gate],
                              stdout=out, stderr=out)
    stack.callback(lambda: Gate(gate).detach())
    stack.callback(stop_daemon, daemon)
    socket = str(configuration.load(config).paths.socket)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.call(socket, "status", timeout=1)
            return daemon
        except client.DaemonUnreachable:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the gpuguard daemon did not start{f'; see {log}' if log else ''}") from None
            time.sleep(0.1)


def stop_daemon(daemon: subprocess.Popen | None) -> None:
    if daemon and daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(15)


@contextmanager
def searchable(path: Path) -> Iterator[None]:
    """Let other users reach `path` (search permission on each directory above it) while inside.

    The demo's users and the tests' users run gpuguard from this checkout's virtual environment;
    a checkout under /root (mode 0700) would otherwise fail for them in ways that look like
    denials. Only o+x is added (no listing), and only where missing; it is taken back after.
    """
    opened = [parent for parent in [path, *path.parents] if not os.stat(parent).st_mode & 0o001]
    for parent in opened:
        os.chmod(parent, os.stat(parent).st_mode | 0o001)
    try:
        yield
    finally:
        for parent in opened:
            os.chmod(parent, os.stat(parent).st_mode & ~0o001)


@contextmanager
def bpffs_restored() -> Iterator[None]:
    """A bpffs that gates mounted inside is unmounted again if nothing is pinned there any more.
    (The daemon keeps its mount, as systemd would.)"""
    mounted_before = bpffs_mounted()
    try:
        yield
    finally:
        if not mounted_before and bpffs_mounted():
            if PIN_ROOT.is_dir() and not any(PIN_ROOT.iterdir()):
                PIN_ROOT.rmdir()
            # maps.debug and progs.debug are the kernel's own (bpf_preload), in every new bpffs.
            if not {entry.name for entry in BPFFS.iterdir()} - {"maps.debug", "progs.debug"}:
                unmount_bpffs()


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for a metrics endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def kill_processes_of(uid: int) -> None:
    """SIGKILL every live process of uid (real or effective), until none is left: a process may
    fork while we look. Zombies are dead already; their parents reap them. (psutil, not pkill:
    procps is not among the packages the Makefile installs.)"""
    def none_left() -> bool:
        found = False
        for proc in psutil.process_iter(["uids", "status"]):
            uids, status = proc.info["uids"], proc.info["status"]
            if uids is None or uid not in (uids.real, uids.effective) or status == psutil.STATUS_ZOMBIE:
                continue
            found = True
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        return not found

    wait_for(none_left, timeout=30)


@contextlib.contextmanager
def log_lines() -> Iterator[list[str]]:
    """The gpuguard logger's lines while inside, formatted as the daemon writes them."""
    from gpuguard.logs import KeyValueFormatter, logger

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(KeyValueFormatter().format(record))

    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
