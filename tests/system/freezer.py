"""A process the kernel will not let die: the cgroup v1 freezer.

    with frozen(proc.pid, sandbox) as cgroup:   # proc is now frozen (state D)
        ...                                     # SIGKILL stays pending until the block ends
    # thawed, moved back to the root cgroup, the cgroup removed: a pending SIGKILL lands now

A frozen task sits in the kernel's refrigerator: a SIGKILL sent to it stays pending and the
task stays in /proc (state D) until it is thawed, which is what "survives SIGKILL" looks like
for real (a task stuck in a driver). Only the v1 freezer does this; cgroup v2's cgroup.freeze
lets SIGKILL through. When no v1 freezer hierarchy is mounted, a private one is mounted under
`scratch` (and unmounted afterwards); the test is skipped only when that is impossible too.
Everything made here is undone when the block ends, whether it passed or failed.
"""
from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import unique

from devtools.harness import wait_for

SETTLE = 60.0  # seconds: a bound on the kernel freezing or thawing a task, never expected


def mounted_freezer() -> Path | None:
    """Where a cgroup v1 hierarchy with the freezer controller is mounted, if anywhere."""
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            separator = fields.index("-")
            fstype, options = fields[separator + 1], fields[separator + 3].split(",")
            if fstype == "cgroup" and "freezer" in options:
                return Path(fields[4].replace("\\040", " "))
    return None


@contextmanager
def freezer_hierarchy(scratch: Path) -> Iterator[Path]:
    """The root of a v1 freezer hierarchy: the mounted one, or a private mount under scratch."""
    root = mounted_freezer()
    if root is not None:
        yield root
        return
    mountpoint = scratch / unique("ggt-freezer")
    mountpoint.mkdir()
    try:
        mount = subprocess.run(["mount", "-t", "cgroup", "-o", "freezer", "ggt-freezer", str(mountpoint)],
                               capture_output=True, text=True)
        if mount.returncode != 0:
            pytest.skip(f"needs the cgroup v1 freezer (a frozen task survives SIGKILL until thawed); "
                        f"none is mounted and mounting one failed: {mount.stderr.strip()}")
        try:
            yield mountpoint
        finally:
            subprocess.run(["umount", str(mountpoint)], check=True)
    finally:
        mountpoint.rmdir()


@contextmanager
def frozen(pid: int, scratch: Path) -> Iterator[Path]:
    """Freeze pid in a new `ggt-` freezer cgroup for the block; yields the cgroup's directory.
    Afterwards the task is thawed and moved back to the root cgroup, and the cgroup removed."""
    with freezer_hierarchy(scratch) as root:
        cgroup = root / unique("ggt-freeze")
        cgroup.mkdir()
        try:
            (cgroup / "cgroup.procs").write_text(str(pid))
            (cgroup / "freezer.state").write_text("FROZEN")
            assert wait_for(lambda: (cgroup / "freezer.state").read_text().strip() == "FROZEN", SETTLE), \
                f"the freezer did not freeze {pid}: {(cgroup / 'freezer.state').read_text().strip()}"
            yield cgroup
        finally:
            (cgroup / "freezer.state").write_text("THAWED")
            for task in (cgroup / "cgroup.procs").read_text().split():
                try:
                    (root / "cgroup.procs").write_text(task)
                except OSError as exc:
                    if exc.errno != errno.ESRCH:  # it exited meanwhile: nothing to move
                        raise
            wait_for(lambda: not (cgroup / "cgroup.procs").read_text().strip(), SETTLE)
            cgroup.rmdir()
