"""holders() and process identity against real processes of real users."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from subprocess import PIPE

import psutil

from conftest import PYTHON, popen_as
from gpuguard.backends.procfs import char_major, holders, process_identity, user_of

PROBE = str(Path(__file__).with_name("gate_probe.py"))


def psutil_ticks(pid: int) -> int:
    """The start time in clock ticks after boot as psutil sees it: a reference independent of ours."""
    return round((psutil.Process(pid).create_time() - psutil.boot_time()) * os.sysconf("SC_CLK_TCK"))


def test_holders_match_the_device_not_the_path(sandbox, make_user) -> None:
    # A private copy of /dev/full: the holder opens it by a path nobody else uses.
    node = sandbox / "full"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    os.chmod(node, 0o666)
    user = make_user()
    holder = popen_as(user, [PYTHON, "-I", "-S", PROBE, "--hold", str(node)], stdin=PIPE, stdout=PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert holder.pid in holders((1, 7))
        assert holder.pid not in holders((1, 3))
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.pid not in holders((1, 7))


def test_identity_of_a_user_process(make_user) -> None:
    user = make_user()
    proc = popen_as(user, ["sleep", "30"])
    try:
        identity = process_identity(proc.pid)
        assert identity is not None
        assert (identity.pid, identity.uid) == (proc.pid, user.uid)
        assert user_of(proc.pid) == user.uid
        # The start time is what tells this process from a later one with the same pid.
        assert identity.start_time == psutil_ticks(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert process_identity(proc.pid) is None and user_of(proc.pid) is None


def test_identity_survives_an_awkward_command_name(sandbox) -> None:
    # comm may contain spaces and parentheses; fields are counted after the last ')'.
    odd = sandbox / "a) b ("
    shutil.copy("/bin/sleep", odd)
    proc = subprocess.Popen([str(odd), "30"])
    try:
        identity = process_identity(proc.pid)
        assert identity is not None and identity.uid == 0
        assert identity.start_time == psutil_ticks(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_char_major() -> None:
    assert char_major("mem") == 1
    assert char_major("ggt-no-such-driver") is None
