"""Processes that hold a GPU node open without a CUDA context (NVML never lists them) and ignore
SIGTERM: every path that takes the GPU away ends them, SIGTERM then SIGKILL after kill_wait."""
from __future__ import annotations

import signal

import pytest
from test_evasion import BOUND
from test_watcher import KILL_WAIT, MARGIN, WATCHER, events, log_lines, session_gpu

from devtools.harness import wait_for

pytestmark = pytest.mark.gate


def assert_ended_with_sigkill(d, user, proc, why: str) -> None:
    """The holder died of SIGKILL, after a SIGTERM it ignored, both recorded for the user."""
    assert proc.wait(timeout=BOUND + KILL_WAIT) == -signal.SIGKILL
    mine = wait_for(lambda: [(e["kind"], e["action"], e["rule"]) for e in events(d, user, pid=proc.pid)]
                    if len(events(d, user, pid=proc.pid)) >= 2 else None, timeout=MARGIN)
    assert mine == [("kill", "term", why), ("kill", "kill", why)], events(d, user)
    term, kill = events(d, user, pid=proc.pid)
    assert "no longer yours" in term["message"] and "SIGTERM" in term["message"]
    assert term["numbers"]["signal"] == "SIGTERM" and kill["numbers"]["signal"] == "SIGKILL"
    assert kill["time"] - term["time"] >= KILL_WAIT
    assert log_lines(d, event="opener_kill", rule=why, grantee=user.uid)  # a few a minute per user, then a count


def test_revoke_ends_a_holder_that_ignores_sigterm(start_daemon, hostile):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    holder = hostile(alice, "holder", d.node(minor))
    reply = d.call("revoke", user=alice.name)
    assert reply["holders"] == [{"pid": holder.pid, "minor": minor}]
    assert f"process {holder.pid} held the node open (no CUDA context): sent SIGTERM, SIGKILL in 1s" in reply["message"]
    assert_ended_with_sigkill(d, alice, holder, "admin")


def test_idle_release_ends_a_holder_nvml_does_not_see(start_daemon, hostile):
    d = start_daemon(defaults={"gpus": 1, "idle_timeout": "1s"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    holder = hostile(alice, "holder", d.node(minor))  # not a CUDA process: the grant is idle
    assert_ended_with_sigkill(d, alice, holder, "idle")
    assert d.grants(alice) == []


def test_expiry_ends_a_holder_nvml_does_not_see(start_daemon, hostile):
    d = start_daemon(defaults={"gpus": 1, "max_time": "2s"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    holder = hostile(alice, "holder", d.node(minor))
    assert_ended_with_sigkill(d, alice, holder, "time")
