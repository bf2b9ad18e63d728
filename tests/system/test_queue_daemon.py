"""The queue in a real daemon (tests/daemon_fixture.py): it survives SIGKILL, a waiting client that
hangs up leaves it, and a login that queues is told on its terminal when the GPU comes."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import popen_as
from sim_helpers import burn, gpuguard
from test_notify import read_until  # a pty's output up to a needle

from devtools.harness import wait_for


def queue_users(d) -> list[str]:
    return [q["user"] for q in d.call("status")["queue"]]


@contextmanager
def waiting_request(d, user) -> Iterator[subprocess.Popen]:
    """`gpuguard request --wait` of `user`, running and in the queue, for the block."""
    waiting = popen_as(user, gpuguard(d.config_path, "request", "--wait"), stdout=-1, stderr=-1, text=True)
    try:
        assert wait_for(lambda: queue_users(d) == [user.name])
        yield waiting
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()


def test_the_queue_survives_a_daemon_sigkill_and_is_served_after_it(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    held = d.open_session(alice)
    assert held["gpus"] == [0]
    queued = d.open_session(bob)
    assert queued["gpus"] == [] and "number 1 of 1 in the queue" in queued["message"]

    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    d.start()
    assert queue_users(d) == [bob.name]
    assert d.whoami(bob)["queue"]["position"] == 1

    d.close_session(alice, held["pid"])  # no process on GPU 0: released at logout, and straight to bob
    assert wait_for(lambda: d.granted_minors(bob) == [0])
    assert queue_users(d) == []


def test_a_waiting_client_that_hangs_up_leaves_the_queue(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    with waiting_request(d, bob) as waiting:
        waiting.send_signal(signal.SIGKILL)  # its connection closes with it
        waiting.wait()
        assert wait_for(lambda: queue_users(d) == [])


def test_request_wait_times_out_with_exit_1_and_leaves(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    result = d.cli_as(bob, "request", "--wait", "--timeout", "1s")
    assert result.returncode == 1 and "left the queue" in result.stderr
    assert queue_users(d) == []
    bad = d.cli_as(bob, "request", "--wait", "--timeout", "-1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_a_wait_on_a_place_that_leaves_the_queue_ends_with_it(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    login = d.open_session(bob)  # queued at login: `request --wait` then waits on the login's place
    assert queue_users(d) == [bob.name]
    # Outside the session (tmux, nohup): the wait goes on after its last session ends.
    waiting = popen_as(bob, gpuguard(d.config_path, "request", "--wait"), stdout=-1, stderr=-1, text=True)
    try:
        assert "in the queue" in waiting.stderr.readline()  # said just before its `wait` call
        time.sleep(1)  # for that call to arrive
        d.close_session(bob, login["pid"])  # the login's place leaves the queue with its last session
        assert queue_users(d) == []
        # Before: nothing would ever serve or refuse it, and the client waited for good.
        assert waiting.wait(timeout=30) == 1
        assert "left the queue" in waiting.stderr.read()
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
        waiting.stdout.close()
        waiting.stderr.close()


def test_request_wait_returns_the_grant_when_a_gpu_is_released(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.call_as(alice, "request")
    with waiting_request(d, bob) as waiting:
        assert d.cli_as(alice, "release").returncode == 0
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        assert "number 1 of 1 in the queue" in err
        assert f"export CUDA_VISIBLE_DEVICES={d.uuid(0)}" in out


def test_a_login_that_queues_is_told_on_its_terminal_when_granted(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    held = d.open_session(alice)
    master, slave = os.openpty()
    try:
        tty = Path(os.ttyname(slave))
        os.chown(tty, bob.uid, -1)
        os.set_blocking(master, False)
        caller = d.caller()
        opened = d.call("session_open", user=bob.name, service="ggt-test", rhost="127.0.0.1",
                        tty=str(tty.relative_to("/dev")), pid=caller.pid)
        assert opened["gpus"] == [] and "you will be told here when it is yours" in opened["message"]
        d.close_session(alice, held["pid"])
        line = f"export CUDA_VISIBLE_DEVICES={d.uuid(0)}".encode()
        told = read_until(master, line)
        assert line in told and b"from the queue" in told
        mine = d.whoami(bob)
        assert [g["minor"] for g in mine["grants"]] == [0] and mine["queue"] is None
        shown = d.cli_as(bob, "whoami").stdout
        assert f"export CUDA_VISIBLE_DEVICES={d.uuid(0)}" in shown
    finally:
        os.close(master)
        os.close(slave)


def test_more_gpus_than_the_server_has_are_refused_and_never_hold_the_queue(start_daemon):
    """A quota above the server's GPUs (4 on 2): an explicit request for more is refused, the
    quota's worth and a login's place are cut to what there is. A waiter the pool shrank under (a
    drain) no longer holds the free GPUs once past reserve_after: the queue behind it is served."""
    d = start_daemon(count=2, gate=False, defaults={"gpus": 4}, scheduler={"reserve_after": "0s"})
    alice, bob, carol = d.add_member(), d.add_member(), d.add_member()
    over = d.cli_as(alice, "request", "--gpus", "3")
    assert over.returncode == 1
    assert over.stderr == ("gpuguard: this server has 2 GPUs of a kind your quota takes; you asked for 3 "
                           "(gpuguard status shows them)\n")
    assert queue_users(d) == [] and d.granted_minors(alice) == []  # nothing queued, nothing held
    assert sorted(d.call_as(alice, "request")["granted"]) == [0, 1]  # the quota's worth: both

    queued = d.open_session(bob)  # both held: bob waits for 2, not 4, which would never come whole
    assert queued["gpus"] == [] and [q["gpus"] for q in d.call("status")["queue"]] == [2]

    assert d.cli("drain", "1", "--reason", "ggt-test").returncode == 0  # bob's 2 can no longer come
    assert d.cli_as(alice, "release").returncode == 0  # GPU 0 free: bob, first and past reserve_after,
    served = d.cli_as(carol, "request", "--wait", "--timeout", "30s")  # cannot take it, nor hold it for ever
    assert served.returncode == 0, served.stderr
    assert d.granted_minors(carol) == [0]
    assert queue_users(d) == [bob.name] and d.granted_minors(bob) == []


def test_a_held_gpu_reclaim_takes_from_a_waiting_user_is_waited_for_again(start_daemon):
    """alice holds GPU 0 (idle) and waits for 1 more (2 in all, her quota); bob works on GPU 1;
    carol waits for 1 after alice. Reclaim takes alice's idle GPU for the queue: her request now
    waits for 2, GPU 0 is held for her (first, past reserve_after), and her request comes whole
    when bob releases, not as GPU 0 alone."""
    d = start_daemon(count=2, gate=False, defaults={"gpus": 2, "reclaim_after": "1s"},
                     watcher={"interval": "0.2s"}, scheduler={"reserve_after": "0s", "max_wait_boost": "0s"})
    alice, bob, carol = d.add_member(), d.add_member(), d.add_member()
    assert d.call_as(alice, "request", gpus=1)["granted"] == [0]
    assert d.call_as(bob, "request", gpus=1)["granted"] == [1]
    with burn(d.config_path, 1, user=bob):
        waiting = popen_as(alice, gpuguard(d.config_path, "request", "--wait"), stdout=-1, stderr=-1, text=True)
        behind = None
        try:
            assert wait_for(lambda: queue_users(d) == [alice.name])
            behind = popen_as(carol, gpuguard(d.config_path, "request", "--wait", "--gpus", "1"), stdout=-1,
                              stderr=-1, text=True)
            assert wait_for(lambda: d.granted_minors(alice) == [] and queue_users(d) == [alice.name, carol.name])
            assert [q["gpus"] for q in d.call("status")["queue"]] == [2, 1]
            assert waiting.poll() is None  # still waiting: GPU 0 alone is not what she asked for
            assert d.granted_minors(carol) == []  # GPU 0 is held for alice
            assert d.cli_as(bob, "release").returncode == 1  # his process holds GPU 1
        except BaseException:
            waiting.kill()
            raise
        finally:
            if behind is not None:
                behind.kill()
                behind.wait()
    assert d.cli_as(bob, "release").returncode == 0
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    assert d.granted_minors(alice) == [0, 1]
    assert f"export CUDA_VISIBLE_DEVICES={d.uuid(0)},{d.uuid(1)}" in out
