"""What an aborted test run leaves behind, and the sweep that removes it at the start of the next.

Every test object has a name made by conftest.unique(): `ggt-` and six hex digits (groups:
`ggt-g-` and six), so a run killed before its teardowns (SIGKILL, a lost terminal, a CI timeout)
leaves only things named that way:

- users (with their homes and processes) and groups;
- PAM service files in /etc/pam.d;
- sandboxes in /tmp (a private PostgreSQL running in one stopped first);
- gates pinned under /sys/fs/bpf/gpuguard, child cgroups of the cgroup v2 root, and the
  allow-all device programs of test_gate (TEST_PROGRAMS) attached to that root.

Only names of exactly that form are touched: `make demo` and bench/run.py name their users, groups,
gates and directories `ggt-demo-*`, `ggt-<user>-*`, `ggt-bench-*`, and may be running right now.

A gate left attached denies every later test user their GPUs, so `sweep_gates` runs under
devtools.harness.gate_test_lock, when no live test of any run can have a gate attached. Users, groups,
PAM files and sandboxes of a run that is still going look the same as leftovers, so
`sweep_accounts_and_files` runs only when no other test run is alive: every session holds a
shared flock for its whole length (on the /etc/pam.d directory, which leaves no file behind), and
`session()` first tries to take it exclusively, without waiting.
"""
from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import pwd
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from devtools import patroni, postgres
from devtools.harness import gate_test_lock, kill_processes_of, wait_for
from gpuguard.backends import bpf
from gpuguard.backends.gate import PIN_ROOT, Gate
from gpuguard.backends.mounts import cgroup2_root

TEST_NAME = re.compile(r"ggt-(?:g-)?[0-9a-f]{6}")
TEST_PROGRAMS = ("ggt_foreign", "ggt_allow_all")  # device programs test_gate attaches, by object name
RUN_LOCK = Path("/etc/pam.d")
PAM_DIR = Path("/etc/pam.d")
SANDBOXES = Path("/tmp")


@contextlib.contextmanager
def session() -> Iterator[list[str]]:
    """For the whole test session: sweep what aborted runs left (see the module doc), then hold the
    run lock shared until the session ends. Yields the lines to report (none: nothing to say)."""
    fd = os.open(RUN_LOCK, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        removed: list[str] = []
        with gate_test_lock():
            removed += sweep_gates()
            if alone:
                removed += sweep_accounts_and_files()
        # Shared from now on (a conversion that is not atomic: a run starting in between may sweep,
        # and finds nothing of ours, which does not exist yet).
        fcntl.flock(fd, fcntl.LOCK_SH)
        report = []
        if removed:
            report += ["gpuguard tests: removed what an aborted run left:", *(f"  {item}" for item in removed)]
        if not alone:
            report.append("gpuguard tests: another test run is going on: no sweep of ggt- users, groups, "
                          "PAM files and sandboxes this time")
        yield report
    finally:
        os.close(fd)


def sweep_gates() -> list[str]:
    """Detach test gates and test programs from the cgroup v2 root, remove test child cgroups.
    Only under gate_test_lock."""
    removed = []
    if PIN_ROOT.is_dir():
        for pinned in sorted(_test_named(PIN_ROOT)):
            Gate(pinned.name).detach()
            removed.append(f"gate {pinned.name}")
    root = cgroup2_root()
    for prog_id, name in bpf.attached_programs(root).items():
        if name in TEST_PROGRAMS:
            detach_by_id(root, prog_id)
            removed.append(f"device program {prog_id} ({name}) on {root}")
    for child in sorted(_test_named(root)):
        if child.is_dir():
            for pid in (child / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            procs = child / "cgroup.procs"
            wait_for(lambda procs=procs: not procs.read_text().split(), timeout=30)
            for prog_id in bpf.attached_ids(child):
                detach_by_id(child, prog_id)
            child.rmdir()
            removed.append(f"cgroup {child}")
    return removed


def detach_by_id(cgroup: Path, prog_id: int) -> None:
    """Detach the device program with this id from the cgroup (gone already: nothing to do)."""
    try:
        prog_fd = bpf.prog_fd_by_id(prog_id)
    except FileNotFoundError:
        return
    try:
        with bpf.opened(cgroup) as cgroup_fd:
            bpf.detach_program(cgroup_fd, prog_fd)
    finally:
        os.close(prog_fd)


def sweep_accounts_and_files() -> list[str]:
    """Remove ggt- users (their processes first), groups, PAM service files and sandboxes.
    Only when no other test run is alive."""
    removed = []
    for user in sorted(pwd.getpwall(), key=lambda entry: entry.pw_name):
        if TEST_NAME.fullmatch(user.pw_name):
            kill_processes_of(user.pw_uid)
            subprocess.run(["userdel", "--remove", "--force", user.pw_name], check=False, capture_output=True)
            removed.append(f"user {user.pw_name}")
    for group in sorted(grp.getgrall(), key=lambda entry: entry.gr_name):
        if TEST_NAME.fullmatch(group.gr_name):
            subprocess.run(["groupdel", group.gr_name], check=False, capture_output=True)
            removed.append(f"group {group.gr_name}")
    for path in sorted(_test_named(PAM_DIR)):
        path.unlink(missing_ok=True)
        removed.append(str(path))
    mounts = _mount_points()
    for path in sorted(_test_named(SANDBOXES)):
        if any(point == path or path in point.parents for point in mounts):
            removed.append(f"(left {path} alone: something is mounted in it)")
            continue
        if path.is_dir() and not path.is_symlink():
            removed += [f"Patroni or etcd process {pid}" for pid in patroni.stop_all_under(path)]
            removed += [f"PostgreSQL in {data}" for data in postgres.stop_all_under(path)]
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(str(path))
    return removed


def _test_named(directory: Path) -> list[Path]:
    return [path for path in directory.glob("ggt-*") if TEST_NAME.fullmatch(path.name)]


def _mount_points() -> list[Path]:
    with open("/proc/self/mountinfo") as lines:
        return [Path(line.split()[4].replace("\\040", " ")) for line in lines]
