"""Device node permissions: 0660 root:root plus per-user ACL entries, restored when a node comes back.

The nodes are copies of /dev/null (1:3) made with mknod, so an open that file permissions allow
really succeeds; the gate plays no part here.

NodeWatcher is driven as the daemon's loop drives it: process() handles what is pending. The kernel
queues an inotify event before the syscall that caused it returns, and inotify keeps the order of
events, so a sentinel node created last and seen by the callback means every earlier event was
handled: that is how the tests know that something did NOT happen, without sleeping.
"""
from __future__ import annotations

import errno
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from probes import open_node, open_result

from devtools.harness import wait_for
from gpuguard.backends.devnodes import ensure_node, set_base_mode
from gpuguard.backends.node_watcher import NodeWatcher
from gpuguard.backends.posix_acl import XATTR, acl_users, apply_acls

NULL = (1, 3)


def handled(watcher: NodeWatcher, predicate: Callable[[], object]) -> object:
    """Let the watcher handle what is pending, then ask predicate (for wait_for)."""
    watcher.process()
    return predicate()


def getfacl(path: Path) -> list[str]:
    out = subprocess.run(["getfacl", "--omit-header", "--numeric", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


@pytest.fixture
def node(sandbox: Path) -> Path:
    path = open_node(sandbox / "nvidia0", NULL)
    set_base_mode(path)
    return path


def test_base_mode_keeps_users_out(node, make_user) -> None:
    st = os.stat(node)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, 0)
    assert open_result(make_user(), node) == "EACCES"


def test_grant_and_revoke(node, make_user) -> None:
    alice, bob = make_user(), make_user()
    apply_acls(node, [alice.uid])
    assert open_result(alice, node) == "ok"
    assert open_result(bob, node) == "EACCES"
    assert getfacl(node) == ["user::rw-", f"user:{alice.uid}:rw-", "group::rw-", "mask::rw-", "other::---"]

    apply_acls(node, [])
    assert open_result(alice, node) == "EACCES"
    # The minimal ACL is the mode alone: the kernel keeps no xattr for it.
    assert getfacl(node) == ["user::rw-", "group::rw-", "other::---"]
    with pytest.raises(OSError) as caught:
        os.getxattr(node, XATTR)
    assert caught.value.errno == errno.ENODATA
    assert stat.S_IMODE(os.stat(node).st_mode) == 0o660


def test_apply_writes_exactly_the_set_and_nothing_when_unchanged(node) -> None:
    assert apply_acls(node, {2001, 2002, 2003}) is True
    assert acl_users(node) == {2001, 2002, 2003}
    assert apply_acls(node, [2002]) is True
    assert acl_users(node) == {2002}

    # Already right: no write, so no IN_ATTRIB for the watcher (a sentinel shows it looked).
    seen: list[Path | None] = []
    watcher = NodeWatcher(node.parent, seen.append, uevents=False)
    try:
        assert apply_acls(node, [2002]) is False
        sentinel = node.parent / "nvidia-sentinel"
        sentinel.touch()
        assert wait_for(lambda: handled(watcher, lambda: sentinel in seen))
        assert seen == [sentinel]
        apply_acls(node, [])  # a change is a write, and the watcher sees it
        assert wait_for(lambda: handled(watcher, lambda: node in seen))
    finally:
        watcher.close()
    assert acl_users(node) == set()


def test_reads_entries_written_by_setfacl(node) -> None:
    subprocess.run(["setfacl", "-m", "u:2005:rw,u:2007:r", str(node)], check=True)
    assert acl_users(node) == {2005, 2007}
    apply_acls(node, acl_users(node) | {2006})
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
    try:
        node = devdir / "nvidia0"
        for _ in range(2):  # created, then removed and created again as nvidia-modprobe does
            node.unlink(missing_ok=True)
            open_node(node, NULL)
            assert wait_for(lambda: handled(watcher, lambda: restored(node)))
            assert open_result(alice, node) == "ok" and open_result(bob, node) == "EACCES"

        os.chmod(node, 0o666)  # something resets the mode: IN_ATTRIB brings it back
        assert wait_for(lambda: handled(watcher, lambda: restored(node)))

        # Our own writes come back as IN_ATTRIB, and then the callback must write nothing, or it
        # would feed itself forever. A non-GPU name is not the callback's business at all.
        (devdir / "unrelated").touch()
        first, second = devdir / "nvidia-sentinel-1", devdir / "nvidia-sentinel-2"
        first.touch()
        assert wait_for(lambda: handled(watcher, lambda: first in calls))  # the echoes came before it
        settled = len(calls)
        second.touch()
        assert wait_for(lambda: handled(watcher, lambda: second in calls))
        assert calls[settled:] == [second]  # nothing for nvidia0 since: our writes stopped
        assert devdir / "unrelated" not in calls
        assert restored(node)
    finally:
        watcher.close()


def test_driver_uevents_reapply_everything(sandbox) -> None:
    """A uevent for a managed major reaches the watcher from the kernel and means "re-apply
    everything"; the same uevent is nothing to a watcher managing other majors.

    The one real uevent this needs is a "change" of /dev/full (1:7, standing in for a GPU): udev,
    if it runs, re-applies /dev/full's own rules (the mode it has already) and nothing else acts
    on a mem device changing. No other uevent can be produced without side effects (a private
    network namespace keeps its uevents to itself, but they carry no major), and the kernel's own
    delivery to the socket is what is under test; what the watcher makes of other payloads is
    tested on recorded uevents (tests/unit/test_acl_uevents.py)."""
    seen: list[Path | None] = []
    others: list[Path | None] = []
    watcher = NodeWatcher(sandbox, seen.append, majors=(1,))
    try:
        other = NodeWatcher(sandbox, others.append, majors=(195,))
        try:
            # The kernel broadcasts the uevent to every listening socket before the write returns.
            Path("/sys/class/mem/full/uevent").write_text("change")
            assert wait_for(lambda: handled(watcher, lambda: None in seen))
            assert seen == [None]  # one "re-apply everything", no path
            other.process()  # it has the same uevent queued (one broadcast)
            assert others == []
        finally:
            other.close()
    finally:
        watcher.close()


def test_a_failing_callback_does_not_stop_the_watch(sandbox) -> None:
    seen: list[Path | None] = []

    def broken(path: Path | None) -> None:
        seen.append(path)
        raise RuntimeError("boom")

    watcher = NodeWatcher(sandbox, broken, uevents=False)
    try:
        (sandbox / "nvidia1").touch()
        assert wait_for(lambda: handled(watcher, lambda: sandbox / "nvidia1" in seen))
        (sandbox / "nvidia2").touch()
        assert wait_for(lambda: handled(watcher, lambda: sandbox / "nvidia2" in seen))
    finally:
        watcher.close()
