"""One gate-attaching test at a time on this machine, across pytest processes.

Two attached gates would both have to allow every open, so a test run seeing another run's gate
(several people testing on one machine) fails with EPERM where it expects ENXIO. The lock is a
flock on the cgroup v2 root directory, which every gate shares and which leaves no file behind.
"""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from gpuguard.backends.mounts import cgroup2_root


@contextmanager
def _locked(mode: int) -> Iterator[None]:
    fd = os.open(cgroup2_root(), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


def gate_test_lock():
    """Held (exclusively) by every test that attaches a gate, for as long as it is attached."""
    return _locked(fcntl.LOCK_EX)


def no_gate_attached():
    """Keep gate-attaching tests waiting while test users open simulated nodes without a daemon:
    a gate attached by any test run on this machine would deny them (EPERM). Shared, so such
    tests still run in parallel with each other. Never use it inside gate_test_lock: the same
    process would wait for itself."""
    return _locked(fcntl.LOCK_SH)
