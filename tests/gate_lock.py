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

from gpuguard.backends.gate import cgroup2_root


@contextmanager
def gate_test_lock() -> Iterator[None]:
    fd = os.open(cgroup2_root(), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
