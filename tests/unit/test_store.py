"""The SQLite store: schema versioning, round trips, and surviving SIGKILL mid-write."""
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuguard.config import EventsConfig
from gpuguard.core.model import Event
from gpuguard.services.store import HOUR, MIGRATIONS, Store, StoreError


@pytest.fixture
def store(tmp_path):
    opened = Store(tmp_path / "state.db")
    yield opened
    opened.close()


def test_fresh_store_is_at_latest_schema_with_wal(store):
    assert store.schema_version == len(MIGRATIONS)
    db = sqlite3.connect(store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_reopening_keeps_data_and_does_not_remigrate(tmp_path):
    first = Store(tmp_path / "state.db")
    first.add_grants(1001, "alice", [2], now=100.0, expires_at=None)
    first.close()
    second = Store(tmp_path / "state.db")
    assert [g.unit for g in second.grants()] == [2]
    assert second.schema_version == len(MIGRATIONS)
    second.close()


def test_newer_schema_is_refused(tmp_path):
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer than this gpuguard"):
        Store(tmp_path / "state.db")


def test_grants_round_trip_and_removal_history(store):
    store.add_grants(1001, "alice", [0, 1], now=10.0, expires_at=3610.0)
    store.add_grants(1002, "bob", [2], now=20.0, expires_at=None, shared=True)
    alice = store.grants(1001)
    assert [(g.unit, g.expires_at, g.last_active, g.shared) for g in alice] == [(0, 3610.0, 10.0, False),
                                                                             (1, 3610.0, 10.0, False)]
    store.mark_active([(1001, 1)], now=50.0)
    assert [g.last_active for g in store.grants(1001)] == [10.0, 50.0]
    removed = store.remove_grants(1001, [1], now=60.0)
    assert [g.unit for g in removed] == [1]
    assert [g.unit for g in store.grants()] == [0, 2]
    assert store.last_released() == {1: 60.0}
    assert [g.unit for g in store.remove_grants(1001, None, now=70.0)] == [0]
    assert store.last_released() == {0: 70.0, 1: 60.0}
    assert store.last_held(1001) == {0: 70.0, 1: 60.0} and store.last_held(1002) == {}


def test_sessions_close_by_caller_pid(store):
    first = store.open_session(1001, "alice", "sshd", "10.0.0.5", "ssh", pid=500, now=1.0)
    store.open_session(1001, "alice", "su", "", "pts/3", pid=600, now=2.0)
    assert [s.pid for s in store.sessions(1001)] == [500, 600]
    assert store.close_session(1001, 500) == first
    assert store.close_session(1001, 500) is None
    assert [s.pid for s in store.sessions()] == [600]


def test_events_newest_first_limit_oldest_first_order(store):
    for i in range(5):
        store.add_event(Event(time=float(i), uid=1001, user="alice", kind="warning", message=f"m{i}",
                              unit=3, pid=42, command="python", rule="memory", action="warn",
                              numbers={"used": i}))
    store.add_event(Event(time=9.0, uid=1002, user="bob", kind="kill", message="other"))
    events = store.events(1001, limit=2)
    assert [e.message for e in events] == ["m3", "m4"]
    assert events[1].numbers == {"used": 4} and events[1].id is not None
    assert len(store.events()) == 6


def event(time: float, uid: int | None, message: str = "") -> Event:
    return Event(time=time, uid=uid, user=f"u{uid}", kind="grant", message=message)


def test_events_beyond_the_newest_per_user_are_dropped_at_each_insert(tmp_path):
    store = Store(tmp_path / "state.db", lambda: EventsConfig(max_age=None, per_user=5))
    try:
        store.add_event(event(0.0, 1002, "bob's only"))
        for i in range(200):  # a user looping request/release
            store.add_event(event(1.0 + i, 1001, f"m{i}"))
            store.add_event(event(1.0 + i, None, f"system {i}"))
        assert [e.message for e in store.events(1001)] == [f"m{i}" for i in range(195, 200)]
        assert [e.message for e in store.events(1002)] == ["bob's only"]  # nobody else loses history
        assert store.event_count() == 5 + 1 + 5
    finally:
        store.close()


def test_events_older_than_max_age_are_dropped(tmp_path):
    store = Store(tmp_path / "state.db", lambda: EventsConfig(max_age=100.0, per_user=1000))
    try:
        store.add_event(event(1000.0, 1002, "old"))
        store.add_event(event(1050.0, 1001, "kept"))
        store.add_event(event(1100.0, 1001, "at the bound"))   # "old" is now exactly max_age old: kept
        assert store.event_count() == 3
        store.add_event(event(1100.5, 1001, "new"))
        assert [e.message for e in store.events()] == ["kept", "at the bound", "new"]
    finally:
        store.close()


def test_usage_accumulates(store):
    store.add_usage(1001, "alice", 0, HOUR, granted=2.0, busy=1.5, idle=0.5)
    store.add_usage(1001, "alice", 0, 2 * HOUR, granted=2.0, idle=2.0)
    store.add_kill(1001, "alice", 0, 2 * HOUR, "memory")
    [row] = store.usage(1001)
    assert (row["granted_seconds"], row["busy_seconds"], row["idle_seconds"], row["kills"]) == (4.0, 1.5, 2.5, 1)


def test_usage_by_hour_sums_per_user_gpu_and_day_within_the_period(store):
    day = 1_700_000_000 // 86400 * 86400  # an hour boundary
    store.add_usage(1001, "alice", 0, day, granted=3600.0, busy=3000.0, idle=600.0)
    store.add_usage(1001, "alice", 1, day + HOUR, granted=1800.0, idle=1800.0)
    store.add_usage(1002, "bob", 1, day + HOUR, granted=3600.0, busy=3600.0)
    store.add_usage(1002, "bob", 1, day + 30 * HOUR, granted=3600.0, busy=3600.0)  # outside the period
    store.add_kill(1001, "alice", 0, day, "memory")
    store.add_kill(1001, "alice", 0, day + HOUR, "memory")
    store.add_kill(1001, "alice", 1, day + HOUR, "stray")
    until = day + 24 * HOUR
    by_user = store.usage_by("user", since=day + 60, until=until)  # since inside the first hour: that hour counts
    assert [(r["key"], r["granted_seconds"], r["busy_seconds"], r["idle_seconds"], r["kills"]) for r in by_user] == [
        ("alice", 5400.0, 3000.0, 2400.0, {"memory": 2, "stray": 1}), ("bob", 3600.0, 3600.0, 0.0, {})]
    by_gpu = store.usage_by("gpu", since=day, until=until)
    assert [(r["key"], r["granted_seconds"]) for r in by_gpu] == [(0, 3600.0), (1, 5400.0)]
    assert [r["granted_seconds"] for r in store.usage_by("gpu", since=day, until=until, uid=1002)] == [3600.0]
    assert sum(r["granted_seconds"] for r in store.usage_by("day", since=day, until=day + 48 * HOUR)) == 12600.0
    assert store.usage_by("user", since=day + 2 * HOUR, until=until, uid=1001) == []


def test_a_users_report_searches_their_own_hours_not_everyones(store):
    """`report` as a user (uid given) reads the hours by uid and time, whatever `since` says: walking
    the whole history of everyone, on the daemon's loop, was any local user's to ask for."""
    queries: list[str] = []
    store._db.set_trace_callback(queries.append)  # the statements as SQLite ran them, values bound
    try:
        store.usage_by("gpu", since=0.0, until=1e10, uid=1001)
    finally:
        store._db.set_trace_callback(None)
    reads = [q for q in queries if q.lstrip().startswith("SELECT")]
    assert len(reads) == 2
    plans = [" ".join(row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + q)) for q in reads]
    assert "USING INDEX usage_hours_by_uid (uid=? AND hour>? AND hour<?)" in plans[0], plans
    assert "USING INDEX kills_hours_by_uid (uid=? AND hour>? AND hour<?)" in plans[1], plans


def test_events_filtered_by_user_time_and_rule(store):
    for t, uid, rule in [(10.0, 1001, "memory"), (20.0, 1002, "memory"), (30.0, 1001, "idle"), (40.0, 1001, "memory")]:
        store.add_event(Event(t, uid, f"u{uid}", "warning", "m", rule=rule))
    assert [e.time for e in store.find_events(uid=1001, rule="memory")] == [10.0, 40.0]
    assert [e.time for e in store.find_events(since=20.0, until=40.0)] == [20.0, 30.0]
    assert [e.time for e in store.find_events(limit=2)] == [30.0, 40.0]
    assert store.known_uid("u1002") == 1002 and store.known_uid("nobody") is None


def test_event_counts_since_counts_only_newer_events(store):
    store.add_event(Event(1.0, 1001, "alice", "kill", "m", rule="memory", action="term"))
    last, counts = store.event_counts_since(0)
    assert counts == [("kill", "memory", "term", 1)]
    assert store.event_counts_since(last) == (last, [])
    store.add_event(Event(2.0, 1001, "alice", "kill", "m", rule="memory", action="term"))
    store.add_event(Event(3.0, 1001, "alice", "warning", "m", rule="stray", action="warn"))
    assert sorted(store.event_counts_since(last)[1]) == [("kill", "memory", "term", 1), ("warning", "stray", "warn", 1)]


def test_failed_transaction_rolls_back(store):
    with pytest.raises(RuntimeError):
        with store.transaction() as db:
            db.execute("INSERT INTO grants (uid, user, minor, granted_at, last_active) VALUES (1, 'x', 1, 0, 0)")
            raise RuntimeError("boom")
    assert store.grants() == []


def test_a_scratch_stores_failed_transaction_rolls_back_too(tmp_path):
    """durable=False keeps its undo journal in memory: lost in a crash, there for a rollback."""
    store = Store(tmp_path / "state.db", durable=False)
    try:
        store.add_grants(1001, "alice", [0], now=1.0, expires_at=None)
        with pytest.raises(RuntimeError):
            with store.transaction() as db:
                db.execute("DELETE FROM grants")
                db.execute("INSERT INTO grants (uid, user, minor, granted_at, last_active) VALUES (1, 'x', 1, 0, 0)")
                raise RuntimeError("boom")
        assert [(g.uid, g.unit) for g in store.grants()] == [(1001, 0)]  # the first read of the table
    finally:
        store.close()


WRITER = textwrap.dedent("""
    import os, sys
    from gpuguard.core.model import Event
    from gpuguard.services.store import Store
    path, uid, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store = Store(path)
    while True:  # each transaction grants one user four GPUs, and says so once it is committed
        store.add_grants(uid, f"user{uid}", range(4), now=float(uid), expires_at=None)
        print(uid, flush=True)
        uid += 1
        if mode == "open" and uid % 10 == 0:
            break
    # mode "open": stop inside a transaction, half of it written, more than the page cache holds,
    # so SQLite has spilled uncommitted pages into the WAL file.
    wal = path + "-wal"
    before = os.path.getsize(wal)
    with store.transaction() as db:
        db.executemany("INSERT INTO grants (uid, user, minor, granted_at, expires_at, last_active)"
                       " VALUES (?, ?, ?, ?, NULL, ?)", [(uid, "half", minor, float(uid), float(uid)) for minor in (0, 1)])
        for i in range(3000):
            db.execute("INSERT INTO events (time, uid, user, kind, message, command, rule, action, numbers)"
                       " VALUES (?, ?, 'half', 'padding', ?, '', '', '', '{}')", (float(i), uid, "x" * 4000))
        print("open", uid, before, os.path.getsize(wal), flush=True)
        sys.stdin.readline()  # killed here
""")


def read_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The writer's next line ("" if it ended); a bound on waiting, not a timing assertion."""
    assert proc.stdout is not None, "the writer is started with stdout=PIPE"
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the writer printed nothing for a minute"
    return proc.stdout.readline().strip()


def rows_by_uid(path) -> dict[int, list[tuple]]:
    """(minor, granted_at) of every grant, by uid, read with plain sqlite3."""
    db = sqlite3.connect(path)
    try:
        rows: dict[int, list[tuple]] = {}
        for uid, minor, granted_at in db.execute("SELECT uid, minor, granted_at FROM grants ORDER BY uid, minor"):
            rows.setdefault(uid, []).append((minor, granted_at))
        return rows
    finally:
        db.close()


def start_writer(path, first_uid: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(first_uid), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def kill(writer: subprocess.Popen) -> None:
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert writer.stdin is not None and writer.stdout is not None, "the writer is started with both pipes"
    writer.stdin.close()
    writer.stdout.close()


def test_sigkill_while_writing_loses_nothing_committed_and_leaves_no_half_grant(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    Store(path).close()
    before: dict[int, list[tuple]] = {}
    for round_ in range(3):
        first = 10_000 + round_ * 1_000_000  # a range of its own: nothing is overwritten
        writer = start_writer(path, first, "stream")
        try:
            committed = [int(read_line(writer)) for _ in range(25)]
        finally:
            kill(writer)  # while it goes on writing: mostly inside a transaction, at no chosen point
        assert committed == list(range(first, first + 25))

        store = Store(path)
        assert store.integrity_ok()
        store.close()
        rows = rows_by_uid(path)
        assert {uid: rows[uid] for uid in before} == before  # earlier rounds untouched
        new = sorted(set(rows) - set(before))
        # Every transaction reported committed is there; any after it is there whole or not at all.
        assert new == list(range(first, first + len(new))) and len(new) >= len(committed)
        for uid in new:
            assert rows[uid] == [(minor, float(uid)) for minor in range(4)]  # four rows, one granted_at
        before = rows


def test_sigkill_inside_a_transaction_leaves_nothing_of_it(tmp_path):
    path = tmp_path / "state.db"
    writer = start_writer(path, 20_000, "open")
    try:
        committed = []
        while not (line := read_line(writer)).startswith("open"):
            committed.append(int(line))
        _, open_uid, wal_before, wal_now = line.split()
        # Uncommitted pages of the open transaction are in the WAL file when the kill lands.
        assert int(wal_now) > int(wal_before) + (1 << 20)
    finally:
        kill(writer)
    assert committed == list(range(20_000, 20_010))

    store = Store(path)
    try:
        assert store.integrity_ok()
        assert store.grants(int(open_uid)) == [] and store.events() == []
        assert [g.uid for g in store.grants()] == [uid for uid in committed for _ in range(4)]
        assert all(g.granted_at == g.uid for g in store.grants())
    finally:
        store.close()


def test_version_one_database_is_upgraded_in_place(tmp_path):
    """A state.db written by the first release (schema 1, before grants had an origin) keeps its
    grants, sessions, events and usage. The file is frozen in tests/unit/data (made by the v1 code of
    commit b3066d5), so an edited old migration cannot pass by rebuilding v1 from today's code."""
    path = tmp_path / "state.db"
    shutil.copy(Path(__file__).parent / "data" / "state-v1.db", path)

    store = Store(path)
    assert store.schema_version == len(MIGRATIONS) > 1
    [grant] = store.grants()
    assert (grant.uid, grant.unit, grant.origin) == (1001, 3, "session")
    [session] = store.sessions()
    assert (session.user, session.tty, session.pid) == ("alice", "pts/1", 4242)
    assert [e.message for e in store.events(1001)] == ["granted at login (sshd)"]
    assert store.last_released() == {2: 5.0}
    store.add_grants(1002, "bob", [1], now=20.0, expires_at=None, origin="admin")
    assert [g.origin for g in store.grants()] == ["session", "admin"]
    totals_before = {(r["uid"], r["minor"]): r["granted_seconds"] for r in store.usage()}
    store.add_usage(1001, "alice", 3, HOUR, granted=60.0)  # the v1 totals go on; the hours start empty
    assert store.usage_by("user", since=0, until=2 * HOUR) == [
        {"key": "alice", "granted_seconds": 60.0, "busy_seconds": 0.0, "idle_seconds": 0.0, "kills": {}}]
    assert [r["granted_seconds"] for r in store.usage(1001) if r["minor"] == 3] == [totals_before.get((1001, 3), 0) + 60]
    store.close()


def _frozen(tmp_path: Path, name: str) -> Store:
    path = tmp_path / "state.db"
    shutil.copy(Path(__file__).parent / "data" / name, path)
    return Store(path)


def _assert_the_schema_8_rows(store: Store) -> None:
    """What the schema-8 code of commit 69ed6dd wrote into state-v8.db (and state-v9.db kept)."""
    assert store.schema_version == len(MIGRATIONS)
    assert [(g.uid, g.unit, g.origin, g.uuid, g.expires_at, g.shared, g.memory) for g in store.grants()][:2] == [
        (1001, 3, "session", "GPU-0003", 3610.0, False, None), (1002, 2, "admin", "GPU-0002", None, False, None)]
    assert store.last_released() == {1: 12.0} and store.last_held(1002) == {1: 12.0}
    [session] = store.sessions()
    assert (session.user, session.rhost, session.tty, session.pid) == ("alice", "10.0.0.5", "pts/1", 4242)
    assert store.caller_starts() == {session.id: 777}
    assert [e.message for e in store.events(1001)] == ["granted at login (sshd)"]
    assert store.usage_by("user", since=0, until=2 * HOUR) == [
        {"key": "alice", "granted_seconds": 60.0, "busy_seconds": 45.0, "idle_seconds": 15.0,
         "kills": {"memory": 1}}]
    [queued] = store.queue()
    assert (queued.waiter.user, queued.waiter.gpus, queued.origin, queued.pid, queued.pid_start) == (
        "carol", 2, "request", 5555, 888)
    assert (queued.quota.gpus, queued.quota.whole_gpus) == (2, False)
    assert store.fairshare() == {1002: (2.0, 12.0)}


def test_a_database_of_schema_8_opens_as_it_was_written(tmp_path):
    """A state.db of schema 8 (grants with origin and uuid, sessions with their caller's start time,
    hourly usage and kills, the queue, fair share, the last release per GPU), frozen in tests/unit/data
    (written by the schema-8 code of commit 69ed6dd): editing a migration that has shipped, instead of
    adding one, changes what such a file reads back, and fails here. Its grants get no memory promise."""
    store = _frozen(tmp_path, "state-v8.db")
    try:
        _assert_the_schema_8_rows(store)
        assert len(store.grants()) == 2
    finally:
        store.close()


def test_a_database_of_the_latest_schema_opens_as_it_was_written(tmp_path):
    """state-v9.db, the latest schema: state-v8.db opened by the schema-9 code (migration 9: a
    shared grant's memory promise, Grant.memory), then a sharing grant with its promise added."""
    store = _frozen(tmp_path, "state-v9.db")
    try:
        _assert_the_schema_8_rows(store)
        assert [(g.uid, g.unit, g.uuid, g.shared, g.memory) for g in store.grants()][2:] == [
            (1003, 1, "GPU-0001", True, 40 << 30)]
    finally:
        store.close()
