"""Holders outside the user: a granted user passes an open node descriptor (SCM_RIGHTS) to other
users' processes, and a setuid-root program inherits one. After a revoke, a non-member's holder
is ended, a member's reported, and the setuid-root one recorded in the user's whoami."""
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


def test_holders_passed_a_descriptor_are_found_after_a_revoke(start_daemon, make_user, sandbox):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice, bob = d.add_member(), d.add_member()
    mallory = make_user()  # not a member
    minor = session_gpu(d, alice)
    meeting = sandbox / "meet"  # where users may bind their sockets, as in /tmp
    meeting.mkdir()
    meeting.chmod(0o1777)
    taker, member = receiver(mallory, meeting / "mallory.sock"), receiver(bob, meeting / "bob.sock")
    try:
        sent = run_as(alice, [PYTHON, "-c", SEND, str(d.node(minor)), str(meeting / "mallory.sock"),
                              str(meeting / "bob.sock")])
        assert sent.returncode == 0, sent.stderr
        assert taker.stdout.readline() == member.stdout.readline() == "holding 1\n"
        reply = d.call("revoke", user=alice.name)
        others = {o["pid"]: o for o in reply["other_holders"]}
        assert others[taker.pid] == {"pid": taker.pid, "uid": mallory.uid, "units": [minor], "ended": True}
        assert others[member.pid] == {"pid": member.pid, "uid": bob.uid, "units": [minor], "ended": False}
        assert reply["holders"] == []  # none of alice's own
        assert taker.wait(timeout=MARGIN) == -signal.SIGTERM
        assert member.poll() is None  # a member's is reported, not ended
        mine = events(d, alice, pid=member.pid)
        assert [(e["kind"], e["action"]) for e in mine] == [("warning", "report")] and "passed on" in mine[0]["message"], mine
        assert [e["kind"] for e in events(d, alice, pid=taker.pid)] == ["kill"]
    finally:
        for proc in (taker, member):
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
