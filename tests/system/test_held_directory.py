"""The held-devices files (backends/visible_devices.py), written by root beside the daemon's socket,
against a user who got to that directory first: the socket may be where users write (an admin's
`socket = "/tmp/gpuguard.sock"`), so `held` may be a link or a directory of theirs. Root must then
write nothing, remove nothing and set no ACL, wherever the link points; in a directory of root's
the files are as before. Real users and their links; the calls are the daemon's own."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from conftest import run_as

from gpuguard.backends import posix_acl
from gpuguard.backends.visible_devices import VisibleDevicesFiles, directory_for

UUIDS = ["GPU-0a1b2c3d-0000-4000-8000-000000000001", "GPU-0a1b2c3d-0000-4000-8000-000000000002"]


def _tmp_like(sandbox: Path) -> Path:
    """A directory like /tmp (sticky, anyone may write), where the admin put the socket."""
    shared = sandbox / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


def test_a_users_link_named_held_gets_no_root_write_or_removal(sandbox, make_user):
    mallory, alice = make_user(), make_user()
    shared = _tmp_like(sandbox)
    target = sandbox / "root-only"  # stands for /etc/sudoers.d: a file named 1001 there would stop sudo
    target.mkdir(mode=0o700)
    admins = target / str(alice.uid)
    admins.write_text("the admin's\n")
    made = run_as(mallory, ["ln", "-s", str(target), str(shared / "held")])
    assert made.returncode == 0, made.stderr
    files = VisibleDevicesFiles(directory_for(shared / "gpuguard.sock"))

    assert files.users() == set()  # what the link points to is not listed
    files.write(alice.uid, [])  # alice holds nothing: her file would be removed
    files.write(mallory.uid, UUIDS)
    assert sorted(os.listdir(target)) == [str(alice.uid)]
    assert admins.read_text() == "the admin's\n"


def test_a_users_own_held_directory_gets_no_file(sandbox, make_user):
    mallory = make_user()
    shared = _tmp_like(sandbox)
    made = run_as(mallory, ["mkdir", "-m", "0755", str(shared / "held")])
    assert made.returncode == 0, made.stderr
    files = VisibleDevicesFiles(directory_for(shared / "gpuguard.sock"))
    files.write(mallory.uid, UUIDS)
    assert os.listdir(shared / "held") == []  # nothing of root's for mallory to rename or swap


def test_in_roots_directory_each_user_reads_their_own_file_alone(sandbox, make_user):
    alice, bob = make_user(), make_user()
    socket_dir = sandbox / "run"
    socket_dir.mkdir()
    socket_dir.chmod(0o755)
    files = VisibleDevicesFiles(directory_for(socket_dir / "gpuguard.sock"))
    assert files.users() == set()  # the daemon's start: the directory made
    files.write(alice.uid, UUIDS)
    held = socket_dir / "held"
    path = held / str(alice.uid)
    info = path.stat()
    # r-- for the owner and for the ACL's mask (in the group bits)
    assert (info.st_uid, stat.S_IMODE(held.stat().st_mode), stat.S_IMODE(info.st_mode)) == (0, 0o755, 0o440)
    assert (posix_acl.USER, 0o4, alice.uid) in posix_acl.acl_entries(path)
    assert run_as(alice, ["cat", str(path)]).stdout == ",".join(UUIDS) + "\n"
    assert run_as(bob, ["cat", str(path)]).returncode != 0
    assert files.users() == {alice.uid} and os.listdir(held) == [str(alice.uid)]  # no temporary left
    files.write(alice.uid, [])
    assert files.users() == set() and os.listdir(held) == []
