"""One lock for every test that installs the package into the real root (test_deb) or watches the
directories it installs into (test_shipped_files): a flock on /usr/share/pam-configs."""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

PACKAGE_LOCK = Path("/usr/share/pam-configs")


@contextlib.contextmanager
def package_lock() -> Iterator[None]:
    fd = os.open(PACKAGE_LOCK, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
