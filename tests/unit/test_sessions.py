"""Is a session's PAM caller still alive? Judged by pid and start time, never by the wall clock."""
from __future__ import annotations

import sqlite3
import subprocess

from gpuguard.backends.processes import HostProcesses
from gpuguard.backends.procfs import process_identity
from gpuguard.services.logout import LogoutRelease
from gpuguard.services.store import MIGRATIONS, Store


def test_the_caller_start_time_column_is_added_to_an_existing_store(tmp_path):
    path = tmp_path / "state.db"
    old = sqlite3.connect(path)
    old.executescript(MIGRATIONS[0] + MIGRATIONS[1] + "PRAGMA user_version=2;")
    old.execute("INSERT INTO sessions (uid, user, service, rhost, tty, pid, opened_at)"
                " VALUES (1001, 'alice', 'sshd', '', '', 500, 1.0)")
    old.commit()
    old.close()
    store = Store(path)
    try:
        assert store.schema_version == len(MIGRATIONS)  # migrated to the latest, through the caller_start one
        (before,) = store.sessions()
        assert (before.user, before.pid) == ("alice", 500)
        after = store.open_session(1002, "bob", "sshd", "", "pts/1", 600, 2.0, caller_start=12345)
        assert store.caller_starts() == {before.id: None, after.id: 12345}
        assert store.close_session(1002, 600) == after  # the start time is not part of what a session shows
    finally:
        store.close()


def test_a_caller_is_alive_while_a_process_with_its_pid_and_start_time_runs(world):
    _caller_alive = LogoutRelease(world.store, world.services.releases, world.services.scans, world.exits,
                                  HostProcesses(), world.sampler).caller_alive  # the host's processes, not the fakes
    caller = subprocess.Popen(["sleep", "infinity"])
    try:
        start = process_identity(caller.pid).start_time
        assert _caller_alive(caller.pid, start)
        assert not _caller_alive(caller.pid, start + 1)  # the pid now names another process
        assert _caller_alive(caller.pid, None)  # a session from before start times were kept
    finally:
        caller.kill()
        caller.wait()
    assert not _caller_alive(caller.pid, start) and not _caller_alive(caller.pid, None)


def test_a_tick_drops_the_sessions_whose_caller_is_gone_and_the_waiters_nobody_waits_for(world):
    for i in range(4):  # the four GPUs held
        world.login(world.lookup.add(f"h{i}", 2000 + i, "gpugroup"), pid=5000 + i)
    eve = world.lookup.add("eve", 1005, "gpugroup")
    world.login(eve, pid=6000)
    assert len(world.store.queue()) == 1
    alive = {5000, 5001, 5002, 5003}  # eve's sshd died without a close_session
    world.sampler.set([(pid, 0, 0, None) for pid in alive])  # the processes the fake edge knows
    starts = world.store.caller_starts()
    for session in world.store.sessions():  # as the sessions were opened: start times of those processes
        assert starts[session.id] is None
    world.logout.drop_dead_sessions()
    assert sorted(s.pid for s in world.store.sessions()) == sorted(alive)
    gone = world.queue.drop_gone(world.logout.caller_alive)
    assert [q.waiter.user for q in gone] == ["eve"] and world.store.queue() == []


def test_a_tick_looks_for_a_bounded_number_of_callers_in_turn(world, monkeypatch):
    """A user's thousands of open sessions cost a tick CALLERS_PER_TICK /proc reads at most; every
    dead one is still found, within a few ticks."""
    from gpuguard.services import logout
    monkeypatch.setattr(logout, "CALLERS_PER_TICK", 10)
    eve = world.lookup.add("eve", 1005, "gpugroup")
    for pid in range(7000, 7035):
        world.store.open_session(eve.uid, eve.name, "sshd", "", "", pid, 0.0)
    alive = set(range(7000, 7035, 2))  # every other caller died without a close_session
    world.sampler.set([(pid, 0, 0, None) for pid in alive])
    looked: list[int] = []
    caller_alive = world.logout.caller_alive
    monkeypatch.setattr(world.logout, "caller_alive", lambda pid, start: looked.append(pid) or caller_alive(pid, start))
    ticks = 0
    while {s.pid for s in world.store.sessions()} != alive:
        looked.clear()
        world.logout.drop_dead_sessions()
        assert len(looked) <= 10
        ticks += 1
        assert ticks <= 4  # 35 sessions, 10 a tick
    assert ticks == 4
