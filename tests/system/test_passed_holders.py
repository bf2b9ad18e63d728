"""Holders outside the user: a granted user passes an open node descriptor (SCM_RIGHTS) to other
users' processes, and a setuid-root program inherits one. After a revoke, a release or a logout,
a holder whose user holds no grant of that GPU is ended, member or not (a member's in both users'
whoami), one whose user shares the GPU by a grant of their own is left alone, and the setuid-root
one is recorded in the user's whoami."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from conftest import PYTHON, popen_as, run_as
from test_watcher import MARGIN, WATCHER, events, session_gpu

from devtools.harness import wait_for

pytestmark = pytest.mark.gate

# Run as the receiving user: take one descriptor on a unix socket, then hold it until killed.
RECEIVE = """
import os, signal, socket, sys
path = sys.argv[1]
server = socket.socket(socket.AF_UNIX)
server.bind(path)
os.chmod(path, 0o777)
server.listen(1)
print("ready", flush=True)
connection, _ = server.accept()
_, fds, _, _ = socket.recv_fds(connection, 16, 1)
print(f"holding {len(fds)}", flush=True)
signal.pause()
"""

# Run as the grantee: open the node (O_PATH: no driver needed), pass it to each socket, then exit.
SEND = """
import os, socket, sys
node = os.open(sys.argv[1], os.O_PATH)
for path in sys.argv[2:]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        socket.send_fds(sock, [b"x"], [node])
"""

# Run as the grantee: open the node without close-on-exec, then become a setuid-root program.
INHERIT = """
import os, sys
node = os.open(sys.argv[1], os.O_PATH)
os.set_inheritable(node, True)
print("ready", flush=True)
os.execv(sys.argv[2], [sys.argv[2], "600"])
"""


def receiver(user, path, stubborn: bool = False) -> subprocess.Popen:
    """A process of `user` that takes a descriptor on a socket at `path` and holds it (stubborn:
    ignoring SIGTERM)."""
    code = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if stubborn else "") + RECEIVE
    proc = popen_as(user, [PYTHON, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def meeting_place(sandbox):
    """Where users may bind their sockets, as in /tmp."""
    meeting = sandbox / "meet"
    meeting.mkdir()
    meeting.chmod(0o1777)
    return meeting


def pass_node(d, grantee, minor: int, *receivers: subprocess.Popen) -> None:
    """The grantee opens the node and passes it to each receiver (their socket is argv[-1])."""
    sent = run_as(grantee, [PYTHON, "-c", SEND, str(d.node(minor)), *(proc.args[-1] for proc in receivers)])
    assert sent.returncode == 0, sent.stderr
    for proc in receivers:
        assert proc.stdout.readline() == "holding 1\n"


def assert_ended_for_both(d, grantee, member, proc, rule: str) -> None:
    """A member's process holding the grantee's node got SIGTERM, recorded in both users' whoami."""
    assert proc.wait(timeout=MARGIN) == -signal.SIGTERM
    theirs = wait_for(lambda: events(d, grantee, pid=proc.pid), timeout=MARGIN)
    assert [(e["kind"], e["action"], e["rule"]) for e in theirs] == [("kill", "term", rule)], theirs
    assert "passed on" in theirs[0]["message"] and "SIGTERM" in theirs[0]["message"]
    own = events(d, member, pid=proc.pid)
    assert [(e["kind"], e["action"], e["rule"]) for e in own] == [("kill", "term", rule)], own
    assert f"your process {proc.pid}" in own[0]["message"] and f"passed on from {grantee.name}" in own[0]["message"]
    assert "no grant" in own[0]["message"], own


def test_holders_passed_a_descriptor_are_ended_after_a_revoke_a_members_too(start_daemon, make_user, sandbox):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice, bob = d.add_member(), d.add_member()
    mallory = make_user()  # not a member
    minor = session_gpu(d, alice)
    meeting = meeting_place(sandbox)
    taker, member = receiver(mallory, meeting / "mallory.sock"), receiver(bob, meeting / "bob.sock")
    try:
        pass_node(d, alice, minor, taker, member)
        reply = d.call("revoke", user=alice.name)
        others = {o["pid"]: o for o in reply["other_holders"]}
        assert others[taker.pid] == {"pid": taker.pid, "uid": mallory.uid, "units": [minor], "ended": True}
        assert others[member.pid] == {"pid": member.pid, "uid": bob.uid, "units": [minor], "ended": True}
        assert reply["holders"] == []  # none of alice's own
        assert taker.wait(timeout=MARGIN) == -signal.SIGTERM
        assert [e["kind"] for e in events(d, alice, pid=taker.pid)] == ["kill"]
        assert_ended_for_both(d, alice, bob, member, "admin")
    finally:
        for proc in (taker, member):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_a_logout_ends_the_holders_of_a_passed_descriptor(start_daemon, make_user, sandbox):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice, bob, mallory = d.add_member(), d.add_member(), make_user()
    opened = d.open_session(alice)
    (minor,) = opened["gpus"]
    meeting = meeting_place(sandbox)
    taker, member = receiver(mallory, meeting / "mallory.sock"), receiver(bob, meeting / "bob.sock")
    try:
        pass_node(d, alice, minor, taker, member)
        d.close_session(alice, opened["pid"])  # alice's last session: none of her processes holds the node
        assert wait_for(lambda: d.grants(alice) == [], timeout=MARGIN)
        assert taker.wait(timeout=MARGIN) == -signal.SIGTERM
        assert [e["rule"] for e in wait_for(lambda: events(d, alice, pid=taker.pid), timeout=MARGIN)] == ["logout"]
        assert_ended_for_both(d, alice, bob, member, "logout")
    finally:
        for proc in (taker, member):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_a_members_holder_on_a_gpu_they_share_by_grant_is_left_alone(start_daemon, sandbox):
    d = start_daemon(count=1, defaults={"gpus": 1, "sharing": True, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice, bob, carol = d.add_member(), d.add_member(), d.add_member()
    minor = session_gpu(d, alice)
    assert session_gpu(d, bob) == minor  # shared: bob holds a grant of the same GPU
    meeting = meeting_place(sandbox)
    sharer, member = receiver(bob, meeting / "bob.sock"), receiver(carol, meeting / "carol.sock")
    try:
        pass_node(d, alice, minor, sharer, member)
        reply = d.call("revoke", user=alice.name)
        assert [(o["pid"], o["ended"]) for o in reply["other_holders"]] == [(member.pid, True)], reply
        assert_ended_for_both(d, alice, carol, member, "admin")  # carol holds no grant of it
        assert sharer.poll() is None  # bob's may be his own work on the GPU he holds
        assert events(d, alice, pid=sharer.pid) == events(d, bob, pid=sharer.pid) == []
    finally:
        for proc in (sharer, member):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_a_setuid_root_holder_is_recorded_in_the_users_whoami(start_daemon, sandbox):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    setuid_sleep = sandbox / "setuid-sleep"
    shutil.copy("/usr/bin/sleep", setuid_sleep)
    os.chown(setuid_sleep, 0, 0)
    setuid_sleep.chmod(0o4755)
    holder = popen_as(alice, [PYTHON, "-c", INHERIT, str(d.node(minor)), str(setuid_sleep)], stdout=subprocess.PIPE,
                      text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        assert wait_for(lambda: open(f"/proc/{holder.pid}/status").read().count("\t0\t") > 0)  # exec'd: euid 0
        d.call("revoke", user=alice.name)
        recorded = wait_for(lambda: events(d, alice, pid=holder.pid), timeout=MARGIN)
        assert [(e["kind"], e["action"]) for e in recorded] == [("warning", "report")], recorded
        assert "runs as root" in recorded[0]["message"] and recorded[0]["minor"] == minor
        assert holder.poll() is None  # root's processes are never signalled
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_release_ends_a_non_members_holder_of_a_passed_descriptor(start_daemon, make_user, sandbox):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice, mallory = d.add_member(), make_user()
    minor = session_gpu(d, alice)
    meeting = sandbox / "meet"
    meeting.mkdir()
    meeting.chmod(0o1777)
    taker = receiver(mallory, meeting / "mallory.sock")
    try:
        sent = run_as(alice, [PYTHON, "-c", SEND, str(d.node(minor)), str(meeting / "mallory.sock")])
        assert sent.returncode == 0, sent.stderr
        assert taker.stdout.readline() == "holding 1\n"
        released = d.call_as(alice, "release")  # none of alice's own processes holds it
        assert released["ok"] and released["released"] == [minor], released
        assert taker.wait(timeout=MARGIN) == -signal.SIGTERM
        assert [e["kind"] for e in events(d, alice, pid=taker.pid)] == ["kill"]
    finally:
        taker.kill()
        taker.wait()
        taker.stdout.close()


def test_a_holder_being_ended_is_not_signalled_again_by_the_next_revoke(start_daemon, make_user, sandbox):
    """A holder that ignores SIGTERM keeps holding until kill_wait; a revoke meanwhile leaves it
    to that: a user may pass a node to thousands of processes, and every release would otherwise
    signal, log and record each of them again."""
    d = start_daemon(defaults={"gpus": 1}, watcher={**WATCHER, "kill_wait": "60s"})
    alice, mallory = d.add_member(), make_user()
    minor = session_gpu(d, alice)
    meeting = sandbox / "meet"
    meeting.mkdir()
    meeting.chmod(0o1777)
    taker = receiver(mallory, meeting / "mallory.sock", stubborn=True)
    try:
        sent = run_as(alice, [PYTHON, "-c", SEND, str(d.node(minor)), str(meeting / "mallory.sock")])
        assert sent.returncode == 0, sent.stderr
        assert taker.stdout.readline() == "holding 1\n"
        first = d.call("revoke", user=alice.name)
        assert [(o["pid"], o["ended"]) for o in first["other_holders"]] == [(taker.pid, True)], first
        assert d.call("grant", user=alice.name, units=[minor])["gpus"] == [minor]
        second = d.call("revoke", user=alice.name)
        assert second["other_holders"] == [], second  # being ended: SIGKILL comes at kill_wait
        assert taker.poll() is None  # SIGTERM ignored, as it chose
        assert [e["kind"] for e in events(d, alice, pid=taker.pid)] == ["kill"]  # one SIGTERM, recorded once
    finally:
        taker.kill()
        taker.wait()
        taker.stdout.close()
