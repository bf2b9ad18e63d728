"""The process index (backends/proc_events.py) against real processes of real users, on the real
kernel's netlink process connector: forks, a uid change (setpriv from root), a setuid-root program
(its real uid stays the user's), exits; an overflowed socket and a fork flood each make it walk
/proc again and come back in sync; and the daemon's logout release, with the index in sync, keeps
the grant of a job that still holds the GPU's node and releases it when the job ends.

The reference for "which processes has this user" is psutil, which reads /proc itself."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
from conftest import PYTHON, popen_as
from prometheus_client.parser import text_string_to_metric_families

from devtools.harness import wait_for
from gpuguard.backends import proc_events

INTERVAL = 0.2  # the test daemon's watcher interval (daemon_fixture)


def real_pids(uid: int) -> set[int]:
    """What /proc says now: the pids whose real uid is uid (psutil's reading, not ours), zombies
    left out (their exit event has come; they hold no descriptor, and only wait for their parent)."""
    found = set()
    for proc in psutil.process_iter(["uids", "status"]):
        uids = proc.info["uids"]
        if uids is not None and uids.real == uid and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.add(proc.pid)
    return found


@contextmanager
def index(**settings) -> Iterator[proc_events.ProcessIndex]:
    found = proc_events.ProcessIndex(**settings)
    assert found.start(), found.reason
    try:
        assert wait_for(lambda: found.in_sync, timeout=30)
        yield found
    finally:
        found.close()


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def test_the_index_follows_forks_uid_changes_and_exits_of_a_real_user(make_user, sandbox) -> None:
    user = make_user()
    with index() as found:
        assert found.pids_of([user.uid]) == real_pids(user.uid)  # none, unless a deleted user's with its uid linger
        # Forked by root, then setresuid to the user (a uid event), then the shell forks twice and execs.
        script = "sleep 300 & sleep 300 & echo ready; exec sleep 300"
        tree = subprocess.Popen(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
                                 "sh", "-c", script], stdout=subprocess.PIPE, text=True)
        # A setuid-root program the user runs: its real uid stays the user's (the gate's view too).
        setuid_sleep = sandbox / "setuid-sleep"
        shutil.copy("/usr/bin/sleep", setuid_sleep)
        os.chown(setuid_sleep, 0, 0)
        setuid_sleep.chmod(0o4755)
        elevated = popen_as(user, [str(setuid_sleep), "300"])
        children: list[int] = []
        try:
            assert tree.stdout.readline() == "ready\n"
            assert wait_for(lambda: psutil.Process(elevated.pid).uids().effective == 0)
            children = [p.pid for p in psutil.Process(tree.pid).children()]
            expected = real_pids(user.uid)
            assert len(children) == 2 and {tree.pid, elevated.pid, *children} <= expected
            assert found.pids_of([user.uid]) == expected
            assert tree.pid not in found.pids_of([0])  # it was root's until setpriv
            os.kill(children[0], 9)
            assert wait_for(lambda: children[0] not in real_pids(user.uid))
            assert found.pids_of([user.uid]) == expected - {children[0]}
        finally:
            for child in children:
                try:
                    os.kill(child, 9)
                except ProcessLookupError:
                    pass
            stop(tree, elevated)
            tree.stdout.close()
        assert wait_for(lambda: real_pids(user.uid) == set())
        assert found.pids_of([user.uid]) == set()
        assert (found.losses, found.fallback_walks) == (0, 0)


def test_an_overflow_loses_sync_and_a_walk_brings_it_back(make_user) -> None:
    user = make_user()
    # A small buffer (about 100 events), and the lock held so that the reading thread cannot drain it
    # while 1,000 processes start and end: the socket overflows (ENOBUFS), as under a fork flood.
    with index(receive_buffer=65536, resync_first=0.2) as found:
        with found._lock:
            burst = popen_as(user, ["sh", "-c", "for i in $(seq 1000); do /bin/true; done; exec sleep 300"])
            assert wait_for(lambda: psutil.Process(burst.pid).name() == "sleep", timeout=60)
        try:
            assert found.pids_of([user.uid]) is None  # out of sync: the caller walks /proc
            assert found.losses == 1 and "overflowed" in found.reason and found.fallback_walks == 1
            assert wait_for(lambda: found.in_sync, timeout=30)
            assert found.resyncs == 1
            assert found.pids_of([user.uid]) == real_pids(user.uid) == {burst.pid}
        finally:
            stop(burst)
        assert wait_for(lambda: found.pids_of([user.uid]) == set())


def test_a_fork_flood_makes_the_index_stand_down_and_it_keeps_only_live_pids(make_user) -> None:
    user = make_user()
    with index(events_per_second=300, resync_first=0.2) as found:
        flood = popen_as(user, ["sh", "-c", "for i in $(seq 2000); do /bin/true & done; wait"])
        try:
            assert wait_for(lambda: found.losses >= 1, timeout=60)
            assert "process events a second" in found.reason
        finally:
            flood.wait(120)
        assert wait_for(lambda: real_pids(user.uid) == set())
        assert wait_for(lambda: found.in_sync, timeout=30) and found.resyncs >= 1
        assert found.pids_of([user.uid]) == set()  # nothing of the flood stays behind
        assert found.size() <= len(psutil.pids()) + 1000  # live pids only (others' tests start and end meanwhile)


def index_metrics(path) -> dict[str, float]:
    text = path.read_text()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("gpuguard_process_index")}


@pytest.mark.gate
def test_after_logout_a_job_holding_the_node_keeps_the_grant_through_the_index(start_daemon, sandbox) -> None:
    textfile = sandbox / "gpuguard.prom"
    d = start_daemon(metrics={"textfile": str(textfile)})
    assert wait_for(lambda: "event=process_index_in_sync" in d.log(), timeout=30), d.log()
    alice = d.add_member()
    opened = d.open_session(alice)
    (minor,) = opened["gpus"]
    # No CUDA context (the simulated GPU's node opens O_PATH only): only a scan of alice's processes finds it.
    code = "import os, sys; os.open(sys.argv[1], os.O_PATH); print('held', flush=True); sys.stdin.read()"
    holder = popen_as(alice, [PYTHON, "-c", code, str(d.node(minor))], stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert d.close_session(alice, opened["pid"])["release_pending"]
        after = time.time() + 5 * INTERVAL
        assert wait_for(lambda: (d.call("status")["sampled_at"] or 0) > after, timeout=30)
        assert d.granted_minors(alice) == [minor]
    finally:
        holder.stdin.close()  # it exits
        holder.wait()
        holder.stdout.close()
    assert wait_for(lambda: d.granted_minors(alice) == [], timeout=30), d.log()
    assert wait_for(lambda: textfile.exists() and index_metrics(textfile).get("gpuguard_process_index_in_sync") == 1)
    metrics = index_metrics(textfile)
    assert metrics["gpuguard_process_index_fallback_walks_total"] == 0, metrics
    assert metrics["gpuguard_process_index_processes"] > 0


def test_a_process_whose_thread_execs_stays_in_the_index(make_user) -> None:
    """execve() from a thread other than the main one: the kernel ends the old leader (an exit
    event for the process's pid) and the thread takes over its pid (an exec event). A holder that
    did this would otherwise vanish from the index while it still holds its descriptors."""
    user = make_user()
    code = "import os, threading; threading.Thread(target=os.execv, args=('/bin/sleep', ['sleep', '300'])).start()"
    with index() as found:
        proc = popen_as(user, [PYTHON, "-c", code])
        try:
            assert wait_for(lambda: psutil.Process(proc.pid).name() == "sleep", timeout=30)
            assert proc.pid in found.pids_of([user.uid]) == real_pids(user.uid)
        finally:
            stop(proc)
