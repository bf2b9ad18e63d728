"""Device node permissions: 0660 root:root plus per-user ACL entries, restored when a node comes back.

The nodes are copies of /dev/null (1:3) made with mknod, so an open that file permissions allow
really succeeds; the gate plays no part here.
"""
from __future__ import annotations

import errno
import json
import os
import select
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON, run_as, wait_for
from gpuguard.backends.acl import (
    XATTR, NodeWatcher, acl_users, apply_acls, ensure_node, grant_acl, revoke_acl, set_base_mode,
)

PROBE = str(Path(__file__).with_name("gate_probe.py"))
NULL = (1, 3)


def opens(user, path: Path) -> str:
    proc = run_as(user, [PYTHON, "-I", "-S", PROBE, str(path)])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["results"][str(path)]


def getfacl(path: Path) -> list[str]:
    out = subprocess.run(["getfacl", "--omit-header", "--numeric", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]



@pytest.fixture
def node(sandbox: Path) -> Path:
    path = sandbox / "nvidia0"
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*NULL))
    os.chmod(path, 0o666)
    set_base_mode(path)
    return path


def test_base_mode_keeps_users_out(node, make_user) -> None:
    st = os.stat(node)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, 0)
    assert opens(make_user(), node) == "EACCES"


def test_grant_and_revoke(node, make_user) -> None:
    alice, bob = make_user(), make_user()
    grant_acl(node, alice.uid)
    assert opens(alice, node) == "ok"
    assert opens(bob, node) == "EACCES"
    assert getfacl(node) == ["user::rw-", f"user:{alice.uid}:rw-", "group::rw-", "mask::rw-", "other::---"]

    revoke_acl(node, alice.uid)
    assert opens(alice, node) == "EACCES"
    # The minimal ACL is the mode alone: the kernel keeps no xattr for it.
    assert getfacl(node) == ["user::rw-", "group::rw-", "other::---"]
    with pytest.raises(OSError) as caught:
        os.getxattr(node, XATTR)
    assert caught.value.errno == errno.ENODATA
    assert stat.S_IMODE(os.stat(node).st_mode) == 0o660


def test_apply_writes_exactly_the_set_and_nothing_when_unchanged(node) -> None:
    apply_acls(node, {2001, 2002, 2003})
    assert acl_users(node) == {2001, 2002, 2003}
    apply_acls(node, [2002])
    assert acl_users(node) == {2002}

    before = os.stat(node).st_ctime_ns
    time.sleep(0.01)
    apply_acls(node, [2002])  # already right: no write, so no IN_ATTRIB for the watcher
    assert os.stat(node).st_ctime_ns == before

    apply_acls(node, [])
    assert acl_users(node) == set()


def test_reads_entries_written_by_setfacl(node) -> None:
    subprocess.run(["setfacl", "-m", "u:2005:rw,u:2007:r", str(node)], check=True)
    assert acl_users(node) == {2005, 2007}
    grant_acl(node, 2006)
    assert getfacl(node)[1:4] == ["user:2005:rw-", "user:2006:rw-", "user:2007:rw-"]


def test_ensure_node(sandbox) -> None:
    path = sandbox / "nvidia7"
    assert ensure_node(path, (195, 7))
    st = os.stat(path)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(195, 7)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, 0)
    assert not ensure_node(path, (195, 7))
    assert ensure_node(path, (195, 8)) and os.stat(path).st_rdev == os.makedev(195, 8)
    ctl = sandbox / "nvidiactl"
    assert ensure_node(ctl, (195, 255), 0o666) and stat.S_IMODE(os.stat(ctl).st_mode) == 0o666


def test_recreated_node_gets_its_acls_back(sandbox, make_user) -> None:
    alice, bob = make_user(), make_user()
    devdir = sandbox / "dev"
    devdir.mkdir()
    os.chmod(devdir, 0o755)
    wanted = {"nvidia0": {alice.uid}}
    calls: list[Path | None] = []

    def reapply(path: Path | None) -> None:
        calls.append(path)
        if path is not None and path.name in wanted and path.exists():
            set_base_mode(path)
            apply_acls(path, wanted[path.name])

    def restored(path: Path) -> bool:
        st = os.stat(path)
        return stat.S_IMODE(st.st_mode) == 0o660 and acl_users(path) == {alice.uid}

    watcher = NodeWatcher(devdir, reapply, uevents=False)
    watcher.start()
    try:
        node = devdir / "nvidia0"
        for _ in range(2):  # created, then removed and created again as nvidia-modprobe does
            node.unlink(missing_ok=True)
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(*NULL))
            os.chmod(node, 0o666)
            assert wait_for(lambda: restored(node))
            assert opens(alice, node) == "ok" and opens(bob, node) == "EACCES"

        os.chmod(node, 0o666)  # something resets the mode: IN_ATTRIB brings it back
        assert wait_for(lambda: restored(node))

        # Our own writes come back as IN_ATTRIB once, then the callback finds nothing to do.
        time.sleep(0.3)
        settled = len(calls)
        time.sleep(0.3)
        assert len(calls) == settled
        (devdir / "unrelated").touch()
        time.sleep(0.1)
        assert all(path is None or path.name.startswith("nvidia") for path in calls)
    finally:
        watcher.close()


def test_driver_uevents_reapply_everything(sandbox) -> None:
    # Driven by polling its fd, as a daemon's main loop would; /dev/full (1:7) stands in for a GPU.
    seen: list[Path | None] = []
    watcher = NodeWatcher(sandbox, seen.append, majors=(1,))
    try:
        Path("/sys/class/mem/full/uevent").write_text("change")
        deadline = time.monotonic() + 5
        while None not in seen and time.monotonic() < deadline:
            if select.select([watcher], [], [], 0.5)[0]:
                watcher.process()
        assert seen and seen[0] is None
    finally:
        watcher.close()


def test_a_failing_callback_does_not_stop_the_watch(sandbox) -> None:
    seen: list[Path | None] = []

    def broken(path: Path | None) -> None:
        seen.append(path)
        raise RuntimeError("boom")

    watcher = NodeWatcher(sandbox, broken, uevents=False)
    watcher.start()
    try:
        (sandbox / "nvidia1").touch()
        assert wait_for(lambda: sandbox / "nvidia1" in seen)
        (sandbox / "nvidia2").touch()
        assert wait_for(lambda: sandbox / "nvidia2" in seen)
    finally:
        watcher.close()
