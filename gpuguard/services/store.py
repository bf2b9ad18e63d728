"""SQLite state: the source of truth for grants, sessions, events and usage.

WAL with synchronous=FULL and one transaction per change: a crash (even SIGKILL in the
middle of a write) loses no committed grant and leaves no half-written one (a replay's scratch
store keeps only the one transaction per change: see Store). The gate map and device ACLs are
derived from this and rebuilt from it at daemon start.

The daemon is the one writer of its state.db: the CLI and the web view ask the daemon, and an
admin who edits it stops the daemon first. So what the services read many times
per change (the grants, the sessions, the queue, fair share, when GPUs were given back) is read
once, when first asked for, and kept up to date by this connection's own writes. Each kept copy
carries a version that moves at each of its changes: a caller that worked something out from a
copy compares versions to know that nothing changed, and the queue's and the grants' copies keep
a log of their changes, so that a caller following them pays for the changes, not the rows.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import json
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar

from gpuguard.config import EventsConfig
from gpuguard.core.errors import GpuguardError
from gpuguard.core.model import Event, Grant, Origin, Quota, Session, unit_parent
from gpuguard.core.scheduler import Waiter

# Ordered migrations: index i brings the schema from version i to i + 1. Never edit a
# released entry; append a new one. Every `minor` column holds a unit (Grant.unit: a whole GPU's
# minor, or a slice's slice_unit); the column kept its first name (see _fields).
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE grants (
        uid INTEGER NOT NULL, user TEXT NOT NULL, minor INTEGER NOT NULL,
        granted_at REAL NOT NULL, expires_at REAL, last_active REAL NOT NULL,
        shared INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (uid, minor));
    CREATE TABLE sessions (
        id INTEGER PRIMARY KEY, uid INTEGER NOT NULL, user TEXT NOT NULL,
        service TEXT NOT NULL, rhost TEXT NOT NULL, tty TEXT NOT NULL,
        pid INTEGER NOT NULL, opened_at REAL NOT NULL);
    CREATE INDEX sessions_by_uid ON sessions (uid);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY, time REAL NOT NULL, uid INTEGER, user TEXT NOT NULL,
        kind TEXT NOT NULL, message TEXT NOT NULL, minor INTEGER, pid INTEGER,
        command TEXT NOT NULL, rule TEXT NOT NULL, action TEXT NOT NULL, numbers TEXT NOT NULL);
    CREATE INDEX events_by_uid ON events (uid, time);
    CREATE TABLE usage (
        uid INTEGER NOT NULL, user TEXT NOT NULL, minor INTEGER NOT NULL,
        granted_seconds REAL NOT NULL DEFAULT 0, busy_seconds REAL NOT NULL DEFAULT 0,
        idle_seconds REAL NOT NULL DEFAULT 0, kills INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (uid, minor));
    CREATE TABLE gpu_history (minor INTEGER PRIMARY KEY, last_released REAL NOT NULL);
    """,
    # Where a grant came from. "session": made while the user had a session (at login, or a
    # request from a login shell); it ends with the user's last session once no process holds
    # it. "request" (asked with no session open) and "admin" last until released, revoked or expired.
    """
    ALTER TABLE grants ADD COLUMN origin TEXT NOT NULL DEFAULT 'session';
    """,
    # The PAM caller's start time (clock ticks after boot, /proc/<pid>/stat field 22): with the
    # pid it names one process for good, whatever the wall clock does. NULL for sessions opened
    # before this column existed, and when the caller was gone by the time the daemon looked.
    """
    ALTER TABLE sessions ADD COLUMN caller_start INTEGER;
    """,
    # Events are pruned by age at every insert (config.EventsConfig): this keeps that a range scan.
    """
    CREATE INDEX events_by_time ON events (time);
    """,
    # Usage with a time dimension, for `gpuguard report`: seconds granted / busy / idle, and
    # processes stopped by each rule, per user and GPU per hour (`hour`: epoch seconds at the
    # start of the UTC hour). The cumulative `usage` table goes on as before.
    """
    CREATE TABLE usage_hours (
        hour INTEGER NOT NULL, uid INTEGER NOT NULL, user TEXT NOT NULL, minor INTEGER NOT NULL,
        granted_seconds REAL NOT NULL DEFAULT 0, busy_seconds REAL NOT NULL DEFAULT 0,
        idle_seconds REAL NOT NULL DEFAULT 0,
        PRIMARY KEY (hour, uid, minor));
    CREATE TABLE kills_hours (
        hour INTEGER NOT NULL, uid INTEGER NOT NULL, user TEXT NOT NULL, minor INTEGER NOT NULL,
        rule TEXT NOT NULL, kills INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (hour, uid, minor, rule));
    """,
    # The queue for GPUs (gpuguard.services.queueing) and each user's recent usage for its fair-share order:
    # `value` GPU-seconds as counted at time `at` (gpuguard.core.scheduler.decay brings it to any later time).
    # A waiter keeps the quota terms it asked with, so the queue serves it without a lookup;
    # origin "session" (a login) waits while its user has a session, "request" while its
    # client (pid, start time) lives.
    """
    CREATE TABLE queue (
        id INTEGER PRIMARY KEY AUTOINCREMENT, uid INTEGER NOT NULL, user TEXT NOT NULL,
        gpus INTEGER NOT NULL, since REAL NOT NULL, priority INTEGER NOT NULL, share REAL NOT NULL,
        quota TEXT NOT NULL, origin TEXT NOT NULL, pid INTEGER, pid_start INTEGER);
    CREATE TABLE fairshare (uid INTEGER PRIMARY KEY, value REAL NOT NULL, at REAL NOT NULL);
    """,
    # When each user last gave back each GPU: a returning user gets the same ones (allocator).
    """
    CREATE TABLE held_last (
        uid INTEGER NOT NULL, minor INTEGER NOT NULL, released_at REAL NOT NULL,
        PRIMARY KEY (uid, minor));
    """,
    # The UUID of the unit a grant is on, as it was when granted (GPU-... or MIG-...): a MIG slice
    # destroyed and re-created under the same GPU instance id keeps its unit number but not its
    # UUID, and such a grant must end (gpuguard.core.layout). '' for grants made before this column.
    """
    ALTER TABLE grants ADD COLUMN uuid TEXT NOT NULL DEFAULT '';
    """,
    # The memory quota a shared grant was promised on its GPU (allocator: sharers' promises never
    # add up to more than the GPU has). NULL: not shared, or shared before this column (then the
    # GPU takes no further sharer: its promise is unknown).
    """
    ALTER TABLE grants ADD COLUMN memory INTEGER;
    """,
    # The units a queue row's user held when it joined that it counts towards what it wants
    # (Queued.counted, a JSON list): one a rule takes back is waited for again (Queue.keep_total).
    """
    ALTER TABLE queue ADD COLUMN counted TEXT NOT NULL DEFAULT '[]';
    """,
    # A user's `gpuguard report` reads their own hours: without these, the key (hour first) made
    # `report --since 0` walk every user's whole history, on the daemon's loop, for any local user.
    """
    CREATE INDEX usage_hours_by_uid ON usage_hours (uid, hour);
    CREATE INDEX kills_hours_by_uid ON kills_hours (uid, hour);
    """,
    # What a user's next grant carries over from those that ended (Grants.allocate): the last use
    # among them and when the latest ended (idle_timeout counts from that use, so release and
    # request does not restart it: policy.idle_since), and when a time limit last took a unit of
    # each kind from them (policy.cool_downs).
    """
    CREATE TABLE last_use (uid INTEGER PRIMARY KEY, at REAL NOT NULL, ended_at REAL NOT NULL);
    CREATE TABLE time_limited (
        uid INTEGER NOT NULL, kind TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (uid, kind));
    """,
    # Utilisation and memory over time (core.use_history): per GPU, per user and the samples
    # taken, in rings of fixed size, one per `step` (60, 600, 3600 s): a bucket replaces the one in
    # its `slot` a ring's span before, so each series keeps at most 372 rows. Sums and counts, so
    # that coarser buckets are sums of finer ones; `start`: epoch seconds, a multiple of `step`.
    """
    CREATE TABLE use_buckets (
        step INTEGER NOT NULL, kind TEXT NOT NULL, key INTEGER NOT NULL, slot INTEGER NOT NULL,
        start INTEGER NOT NULL, n INTEGER NOT NULL, util_n INTEGER NOT NULL, util_sum REAL NOT NULL,
        util_peak REAL, mem_sum REAL NOT NULL, mem_peak REAL NOT NULL, total REAL NOT NULL,
        PRIMARY KEY (step, kind, key, slot));
    """,
)
HOUR = 3600
_Read = TypeVar("_Read")
PRUNE_EVERY = 10  # a user's events beyond per_user are dropped every per_user // PRUNE_EVERY of theirs (add_events)


class StoreError(GpuguardError):
    """The state database cannot be opened or is from a newer gpuguard."""


@dataclass(frozen=True)
class Queued:
    """A queue row: the waiter, the quota terms it is served on, and what keeps it waiting."""

    waiter: Waiter
    quota: Quota
    origin: Origin         # session or request
    pid: int | None        # the client (request) or PAM caller (session)
    pid_start: int | None  # its start time (clock ticks after boot), None when unknown
    # The units its user held when it joined and counts on (it asked for the rest: waiter.gpus),
    # as long as they stay theirs: one a rule takes back is waited for again (Queue.keep_total).
    counted: tuple[int, ...] = ()


class Store:
    def __init__(self, path: Path | str, retention: Callable[[], EventsConfig] = EventsConfig, durable: bool = True):
        """retention: the events kept, read at each event (the config in force: a reload changes it)."""
        self.path = Path(path)
        self.retention = retention
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per change.
        self._db = sqlite3.connect(self.path, isolation_level=None, timeout=10)
        self._db.row_factory = sqlite3.Row
        # The kept copies (see the module's text), each read when first asked for.
        self._grants = _Grants()
        self._sessions = _Sessions()
        self._queue = _Queue()
        self._fairshare: dict[int, tuple[float, float]] | None = None
        self._releases: tuple[dict[int, float], dict[int, dict[int, float]]] | None = None
        self._time_limited: dict[int, dict[str, float]] | None = None
        self._unpruned: dict[int | None, int] = {}  # uid -> its events added since its last prune (add_events)
        if durable:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
        else:
            # A scratch store (a replay's): nothing to keep across a crash, so no fsync and the undo
            # journal in memory (a transaction still rolls back); no other process opens it, so this
            # connection keeps its locks. A transaction costs a third of one in WAL mode without fsync.
            self._db.execute("PRAGMA journal_mode=MEMORY")
            self._db.execute("PRAGMA synchronous=OFF")
            self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        self._db.close()

    @property
    def schema_version(self) -> int:
        version: int = self._db.execute("PRAGMA user_version").fetchone()[0]
        return version

    def _migrate(self) -> None:
        version = self.schema_version
        if version > len(MIGRATIONS):
            raise StoreError(f"{self.path}: schema version {version} is newer than this gpuguard "
                             f"({len(MIGRATIONS)}); upgrade gpuguard")
        for target, script in enumerate(MIGRATIONS[version:], start=version + 1):
            with self.transaction():
                for statement in filter(str.strip, script.split(";")):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version={target}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic change; BEGIN IMMEDIATE so concurrent writers queue instead of failing late."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def integrity_ok(self) -> bool:
        return bool(self._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok")

    # --- grants

    def add_grants(self, uid: int, user: str, units: Iterable[int], now: float,
                   expires_at: float | None, shared: bool = False, origin: Origin = Origin.SESSION,
                   uuids: Mapping[int, str] | None = None, memory: int | None = None,
                   last_active: float | None = None) -> None:
        """uuids: unit -> its UUID now (Grant.uuid); a unit missing there is recorded with ''.
        memory: a shared grant's memory quota per GPU (Grant.memory). last_active: where its idle
        clock starts (policy.idle_since), now when not given."""
        uuids = uuids or {}
        active = float(now if last_active is None else last_active)
        added = [Grant(uid, user, unit, float(now), None if expires_at is None else float(expires_at), active,
                       bool(shared), Origin(origin), uuids.get(unit, ""), memory if shared else None)
                 for unit in units]
        with self.transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO grants (uid, user, minor, granted_at, expires_at, last_active, shared, origin,"
                " uuid, memory) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(g.uid, g.user, g.unit, g.granted_at, g.expires_at, g.last_active, int(g.shared), g.origin, g.uuid,
                  g.memory) for g in added])
        self._grants.put(added)

    def grants(self, uid: int | None = None) -> list[Grant]:
        """The grants by uid and unit (of one user when uid is given)."""
        copy = self._grant_copy()
        return list(copy.rows()) if uid is None else copy.of_user(uid)

    def grants_on(self, gpus: Iterable[int]) -> list[Grant]:
        """The grants on these GPUs (by parent: a slice's grant is on its GPU), by uid and unit."""
        copy = self._grant_copy()
        return sorted((g for gpu in set(gpus) for g in copy.on_gpu(gpu)), key=_grant_order)

    def grants_read(self) -> tuple[Grant, ...]:
        """The grants as grants() lists them, without a copy of the list (do not change it)."""
        return self._grant_copy().rows()

    @property
    def grants_version(self) -> int:
        """Moves at every change of the grants (given, taken back, marked active)."""
        return self._grant_copy().version

    def grant_changes(self) -> GrantChanges | None:
        """The grants gone and come since the last call (a grant changed in place, as a mark, is
        neither: it is the same grant; one that came and went since is in neither either), at the
        cost of the changes rather than of every grant: for a caller that follows each change, as a
        replay does after each batch of events. None at the first call: nothing was followed yet."""
        return self._grant_copy().take_changes()

    def _grant_copy(self) -> _Grants:
        if not self._grants.read_once:
            self._grants.read(self._db.execute("SELECT * FROM grants"))
        return self._grants

    def remove_grants(self, uid: int, units: Iterable[int] | None, now: float,
                      last_use: float | None = None) -> list[Grant]:
        """Remove a user's grants (all, or those units); returns what was removed. last_use: when
        a process of theirs was last on one of them, kept for their next grant (last_use()); None:
        nothing is carried over, and what was is forgotten (an idle release: they start afresh)."""
        with self.transaction() as db:
            wanted = set(units) if units is not None else None
            removed = [g for g in self._grant_copy().of_user(uid) if wanted is None or g.unit in wanted]
            if removed and last_use is None:
                db.execute("DELETE FROM last_use WHERE uid = ?", (uid,))
            elif removed:
                db.execute("INSERT INTO last_use (uid, at, ended_at) VALUES (?, ?, ?) ON CONFLICT (uid)"
                           " DO UPDATE SET at = max(at, excluded.at), ended_at = excluded.ended_at", (uid, last_use, now))
            db.executemany("DELETE FROM grants WHERE uid = ? AND minor = ?", [(g.uid, g.unit) for g in removed])
            db.executemany("INSERT OR REPLACE INTO gpu_history (minor, last_released) VALUES (?, ?)",
                           [(g.unit, now) for g in removed])
            db.executemany("INSERT OR REPLACE INTO held_last (uid, minor, released_at) VALUES (?, ?, ?)",
                           [(g.uid, g.unit, now) for g in removed])
        self._grants.drop(removed)
        if self._releases is not None:  # written: the copy follows
            released, last_held = self._releases
            for grant in removed:
                released[grant.unit] = float(now)
                last_held.setdefault(grant.uid, {})[grant.unit] = float(now)
        return removed

    def mark_active(self, slots: Iterable[tuple[int, int]], now: float) -> None:
        """Set last_active to now for these (uid, unit) grants, in one transaction."""
        slots = set(slots)
        if not slots:
            return
        with self.transaction() as db:
            db.executemany("UPDATE grants SET last_active = ? WHERE uid = ? AND minor = ?",
                           [(now, uid, unit) for uid, unit in slots])
        self._grants.mark_active(slots, float(now))

    def last_use(self, uid: int) -> tuple[float, float] | None:
        """Of the user's grants that ended (remove_grants): when a process of theirs was last on one,
        and when the latest ended; None when nothing is carried over."""
        row = self._db.execute("SELECT at, ended_at FROM last_use WHERE uid = ?", (uid,)).fetchone()
        return None if row is None else (float(row[0]), float(row[1]))

    def note_time_limited(self, uid: int, kinds: Iterable[str], now: float) -> None:
        """A time limit took units of these kinds (policy.unit_kind) from this user now."""
        kinds = set(kinds)
        with self.transaction() as db:
            db.executemany("INSERT OR REPLACE INTO time_limited (uid, kind, at) VALUES (?, ?, ?)",
                           [(uid, kind, now) for kind in kinds])
        self._time_limits().setdefault(uid, {}).update(dict.fromkeys(kinds, float(now)))

    def time_limited(self, uid: int) -> dict[str, float]:
        """kind -> when a time limit last took a unit of that kind from this user."""
        return dict(self._time_limits().get(uid, {}))

    def _time_limits(self) -> dict[int, dict[str, float]]:
        """time_limited, kept: every grant and every queue row's reason asks."""
        if self._time_limited is None:
            self._time_limited = {}
            for uid, kind, at in self._db.execute("SELECT uid, kind, at FROM time_limited"):
                self._time_limited.setdefault(uid, {})[kind] = at
        return self._time_limited

    def last_held(self, uid: int) -> dict[int, float]:
        """When this user last gave back each GPU they ever held (for sticky allocation)."""
        return dict(self._released()[1].get(uid, {}))

    def last_released(self) -> dict[int, float]:
        """When each GPU was last given back (for least-recently-used allocation)."""
        return dict(self._released()[0])

    def _released(self) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
        """gpu_history and held_last (uid -> unit -> when), kept: the allocator asks at every
        choice, and only remove_grants writes them."""
        if self._releases is None:
            held: dict[int, dict[int, float]] = {}
            for uid, minor, released_at in self._db.execute("SELECT uid, minor, released_at FROM held_last"):
                held.setdefault(uid, {})[minor] = released_at
            self._releases = ({row[0]: row[1] for row in self._db.execute("SELECT minor, last_released FROM gpu_history")},
                              held)
        return self._releases

    # --- sessions

    def open_session(self, uid: int, user: str, service: str, rhost: str, tty: str, pid: int,
                     now: float, caller_start: int | None = None) -> Session:
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO sessions (uid, user, service, rhost, tty, pid, opened_at, caller_start)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (uid, user, service, rhost, tty, pid, now, caller_start))
        session = Session(_row_id(cursor), uid, user, service, rhost, tty, pid, float(now))
        self._sessions.put(session, caller_start)
        return session

    def close_session(self, uid: int, pid: int) -> Session | None:
        """Close the newest open session of uid opened by the PAM caller pid."""
        with self.transaction() as db:
            # exact here: no other connection writes until COMMIT
            closed = self._session_copy().newest_of(uid, pid)
            if closed is not None:
                db.execute("DELETE FROM sessions WHERE id = ?", (closed.id,))
        if closed is not None:
            self._sessions.drop([closed.id])
        return closed

    def remove_sessions(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        with self.transaction() as db:
            db.executemany("DELETE FROM sessions WHERE id = ?", [(i,) for i in ids])
        self._sessions.drop(ids)

    def sessions(self, uid: int | None = None) -> list[Session]:
        """The open sessions by id (of one user when uid is given)."""
        copy = self._session_copy()
        return list(copy.rows()) if uid is None else copy.of_user(uid)

    def ttys(self, uid: int) -> list[str]:
        """The terminals of uid's open sessions, each once: where they are told (a user's thousands
        of open batch sessions share a few)."""
        return self._session_copy().ttys_of(uid)

    def logged_in(self, uid: int) -> bool:
        """Whether the user has an open session (without listing a user's thousands of batch jobs')."""
        return self._session_copy().has_user(uid)

    def users_logged_in(self) -> set[int]:
        """The uids with an open session (a step per user, not per session)."""
        return self._session_copy().uids()

    def caller_starts(self) -> dict[int, int | None]:
        """Session id -> the start time of its PAM caller (None when unknown)."""
        return self._session_copy().caller_starts()

    def _session_copy(self) -> _Sessions:
        if not self._sessions.read_once:
            self._sessions.read(self._db.execute("SELECT * FROM sessions"))
        return self._sessions

    # --- events

    def add_event(self, event: Event) -> None:
        self.add_events([event])

    def add_events(self, events: Iterable[Event]) -> None:
        """Store events of one moment (a grant's units given or taken back: one time), in one
        transaction, and drop what the retention no longer keeps: events older than max_age, and a
        user's beyond their newest per_user. The age bound is applied at each call (one index
        range); a user's at their first event after the store opened and then at every
        per_user // PRUNE_EVERY-th (finding the newest per_user costs a walk over them), so a user
        has at most per_user + per_user // PRUNE_EVERY - 1 events kept, whatever the rate. What
        stays is what adding the events one call each would leave. A retention of 0 per user
        keeps none (a replay's store: nobody reads it), so nothing is written."""
        retention = self.retention()
        if retention.per_user == 0:
            return
        events = list(events)
        if not events:
            return
        every = max(1, retention.per_user // PRUNE_EVERY)
        unpruned = {uid: self._unpruned.get(uid, every - 1) + added
                    for uid, added in Counter(event.uid for event in events).items()}
        with self.transaction() as db:
            db.executemany(
                "INSERT INTO events (time, uid, user, kind, message, minor, pid, command, rule, action, numbers)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(event.time, event.uid, event.user, event.kind, event.message, event.unit, event.pid,
                  event.command, event.rule, event.action, json.dumps(event.numbers)) for event in events])
            if retention.max_age is not None:
                db.execute("DELETE FROM events WHERE time < ?", (max(e.time for e in events) - retention.max_age,))
            for uid, since in unpruned.items():
                if since >= every:  # pruned at its last every-th event here: the since % every after it stay too
                    db.execute("DELETE FROM events WHERE uid IS ? AND id <= (SELECT id FROM events WHERE uid IS ?"
                               " ORDER BY id DESC LIMIT 1 OFFSET ?)", (uid, uid, retention.per_user + since % every))
        self._unpruned.update({uid: since % every for uid, since in unpruned.items()})

    def event_count(self) -> int:
        count: int = self._db.execute("SELECT count(*) FROM events").fetchone()[0]
        return count

    def events(self, uid: int | None = None, limit: int = 50) -> list[Event]:
        """The newest events (of one user, or all), oldest first."""
        query, params = _rows_of("events", uid)
        rows = self._db.execute(query + " ORDER BY id DESC LIMIT ?", (*params, limit)).fetchall()
        return [_event(row) for row in reversed(rows)]

    def find_events(self, uid: int | None = None, since: float | None = None, until: float | None = None,
                    rule: str | None = None, limit: int = 1000) -> list[Event]:
        """The newest `limit` events matching every filter given, oldest first."""
        where, params = _filters(uid=uid, rule=rule)
        if since is not None:
            where.append("time >= ?")
            params.append(since)
        if until is not None:
            where.append("time < ?")
            params.append(until)
        rows = self._db.execute(f"SELECT * FROM events {_where(where)} ORDER BY id DESC LIMIT ?",
                                (*params, limit)).fetchall()
        return [_event(row) for row in reversed(rows)]

    def last_event_id(self) -> int:
        last: int = self._db.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0]
        return last

    def event_counts_since(self, after_id: int) -> tuple[int, list[tuple[str, str, str, int]]]:
        """(kind, rule, action, count) of the events newer than id `after_id`, and the newest id."""
        newest = self.last_event_id()
        rows = self._db.execute("SELECT kind, rule, action, count(*) FROM events WHERE id > ? AND id <= ?"
                                " GROUP BY kind, rule, action", (after_id, newest)).fetchall()
        return max(newest, after_id), [tuple(row) for row in rows]

    def known_uid(self, name: str) -> int | None:
        """The uid a user of this name last had in the records (for accounts deleted since)."""
        row = self._db.execute("SELECT uid FROM usage WHERE user = ? UNION ALL"
                               " SELECT uid FROM events WHERE user = ? AND uid IS NOT NULL LIMIT 1",
                               (name, name)).fetchone()
        return row[0] if row else None

    # --- usage accounting

    def add_usage(self, uid: int, user: str, unit: int, hour: int, granted: float = 0.0, busy: float = 0.0,
                  idle: float = 0.0) -> None:
        """Seconds granted / busy / idle in `hour` (hour_of()), added to that hour and to the totals."""
        with self.transaction() as db:
            _add_usage_total(db, uid, user, unit, granted, busy, idle, 0)
            db.execute(
                "INSERT INTO usage_hours (hour, uid, user, minor, granted_seconds, busy_seconds, idle_seconds)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (hour, uid, minor) DO UPDATE SET"
                " granted_seconds = granted_seconds + excluded.granted_seconds,"
                " busy_seconds = busy_seconds + excluded.busy_seconds,"
                " idle_seconds = idle_seconds + excluded.idle_seconds",
                (hour, uid, user, unit, granted, busy, idle))

    def add_kill(self, uid: int, user: str, unit: int, hour: int, rule: str) -> None:
        """One process of the user stopped (SIGTERM) by `rule` in `hour`."""
        with self.transaction() as db:
            _add_usage_total(db, uid, user, unit, 0.0, 0.0, 0.0, 1)
            db.execute(
                "INSERT INTO kills_hours (hour, uid, user, minor, rule, kills) VALUES (?, ?, ?, ?, ?, 1)"
                " ON CONFLICT (hour, uid, minor, rule) DO UPDATE SET kills = kills + 1",
                (hour, uid, user, unit, rule))

    def usage_by(self, by: str, since: float, until: float, uid: int | None = None) -> list[dict[str, Any]]:
        """Seconds granted / busy / idle summed per `by` (user, gpu or day: the daemon's local
        date) over the hours that start in [hour_of(since), until); key, seconds, and kills: {rule: n}."""
        key = _GROUP_KEYS[by]
        where, params = _filters(uid=uid)
        where += ["hour >= ?", "hour < ?"]
        params += [hour_of(since), until]
        rows = {row["key"]: {**dict(row), "kills": {}} for row in self._db.execute(
            f"SELECT {key} AS key, sum(granted_seconds) AS granted_seconds, sum(busy_seconds) AS busy_seconds,"
            f" sum(idle_seconds) AS idle_seconds FROM usage_hours {_where(where)} GROUP BY {key}", params)}
        for row in self._db.execute(f"SELECT {key} AS key, rule, sum(kills) FROM kills_hours {_where(where)}"
                                    f" GROUP BY {key}, rule", params):
            entry = rows.setdefault(row["key"], {"key": row["key"], "granted_seconds": 0.0, "busy_seconds": 0.0,
                                                 "idle_seconds": 0.0, "kills": {}})
            entry["kills"][row["rule"]] = row[2]
        return sorted(rows.values(), key=lambda r: r["key"])

    def usage(self, uid: int | None = None) -> list[dict[str, Any]]:
        query, params = _rows_of("usage", uid)
        return [dict(row) for row in self._db.execute(query + " ORDER BY uid, minor", params)]

    # --- utilisation and memory over time (services.use_history)

    def add_use_buckets(self, rows: Iterable[tuple[Any, ...]], sums: Iterable[tuple[int, int, int, int, int]] = (),
                        prune: Iterable[tuple[int, int]] = ()) -> None:
        """In one transaction: buckets written (step, kind, key, slot, start, n, util_n, util_sum,
        util_peak, mem_sum, mem_peak, total), each replacing its slot's; then, in order, coarser
        buckets summed from finer ones, (step, length, finer step, since, until): every bucket of
        `step` starting in [since, until) from the finer buckets in it; then rows of a step older than a
        moment dropped, (step, before): series that no longer appear (a user gone, a slice destroyed)."""
        with self.transaction() as db:
            db.executemany(f"INSERT OR REPLACE INTO use_buckets ({_BUCKET_COLUMNS}) VALUES ({', '.join('?' * 12)})",
                           rows)
            for step, length, finer, since, until in sums:
                db.execute(
                    f"INSERT OR REPLACE INTO use_buckets ({_BUCKET_COLUMNS}) SELECT :step, kind, key,"
                    " (start / :step) % :length, (start / :step) * :step, sum(n), sum(util_n), sum(util_sum),"
                    " max(util_peak), sum(mem_sum), max(mem_peak), max(total) FROM use_buckets"
                    " WHERE step = :finer AND start >= :since AND start < :until GROUP BY kind, key, start / :step",
                    {"step": step, "length": length, "finer": finer, "since": since, "until": until})
            db.executemany("DELETE FROM use_buckets WHERE step = ? AND start < ?", prune)

    def use_buckets(self, step: int, since: int, until: int, uids: Iterable[int] | None = None) -> list[tuple[Any, ...]]:
        """The buckets of `step` starting in [since, until): (kind, key, start, n, util_n, util_sum,
        util_peak, mem_sum, mem_peak, total), the users' only of `uids` (None: everyone's)."""
        query = ("SELECT kind, key, start, n, util_n, util_sum, util_peak, mem_sum, mem_peak, total FROM use_buckets"
                 " WHERE step = ? AND start >= ? AND start < ?")
        params: list[Any] = [step, since, until]
        if uids is not None:
            wanted = sorted(set(uids))
            query += f" AND (kind != 'user' OR key IN ({', '.join('?' * len(wanted))}))" if wanted else " AND kind != 'user'"
            params += wanted
        return [tuple(row) for row in self._db.execute(query, params)]

    def use_bucket_range(self, step: int) -> tuple[int, int] | None:
        """The starts of the oldest and the newest bucket of `step` kept, None when there is none."""
        row = self._db.execute("SELECT min(start), max(start) FROM use_buckets WHERE step = ?", (step,)).fetchone()
        return None if row[0] is None else (int(row[0]), int(row[1]))

    # --- the queue

    def join_queue(self, uid: int, user: str, gpus: int, now: float, quota: Quota, origin: Origin,
                   pid: int | None = None, pid_start: int | None = None, counted: Iterable[int] = ()) -> Queued:
        counted = tuple(counted)
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO queue (uid, user, gpus, since, priority, share, quota, origin, pid, pid_start, counted)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                # vars, not asdict: the same JSON (Quota's fields are flat) without asdict's deep copy
                (uid, user, gpus, now, quota.priority, quota.share, json.dumps(vars(quota)), origin, pid,
                 pid_start, json.dumps(counted)))
        joined = Queued(Waiter(_row_id(cursor), uid, user, gpus, float(now), quota.priority, float(quota.share)),
                        quota, Origin(origin), pid, pid_start, counted)
        self._queue.joined(joined)
        return joined

    def queue(self, uid: int | None = None) -> list[Queued]:
        rows = self.queue_read()
        return list(rows) if uid is None else [q for q in rows if q.waiter.uid == uid]

    def queue_read(self) -> tuple[Queued, ...]:
        """The queue by id, without a copy of the rows (do not change them)."""
        return self._queue_copy().rows

    @property
    def queue_version(self) -> int:
        """Moves at every change of the queue (a row joined, left, or grew)."""
        return self._queue_copy().version

    def queue_changes(self, since: int) -> list[QueueChange] | None:
        """The queue's changes after version `since`, oldest first; None when they are no longer
        kept (a caller that far behind works the queue out afresh)."""
        return self._queue_copy().changes(since)

    def _queue_copy(self) -> _Queue:
        if not self._queue.read_once:
            self._queue.read(tuple(map(_queued, self._db.execute("SELECT * FROM queue ORDER BY id"))))
        return self._queue

    def regrow_queued(self, queued: Queued, gpus: int, counted: tuple[int, ...]) -> None:
        """A queue row now waiting for `gpus`, counting on `counted` (its place and id kept: a
        waiting client holds the id)."""
        with self.transaction() as db:
            db.execute("UPDATE queue SET gpus = ?, counted = ? WHERE id = ?",
                       (gpus, json.dumps(counted), queued.waiter.id))
        self._queue.regrown(queued, replace(queued, waiter=replace(queued.waiter, gpus=gpus), counted=counted))

    def leave_queue(self, ids: Iterable[int]) -> int:
        """Remove these queue rows; how many were there."""
        ids = set(ids)
        with self.transaction() as db:
            removed: int = db.executemany("DELETE FROM queue WHERE id = ?", [(i,) for i in ids]).rowcount
        self._queue.left(ids)
        return removed

    def fairshare(self) -> dict[int, tuple[float, float]]:
        """uid -> (GPU-seconds, the time they are counted at) charged for ended grants."""
        if self._fairshare is None:
            self._fairshare = {row[0]: (row[1], row[2]) for row in self._db.execute("SELECT uid, value, at FROM fairshare")}
        return dict(self._fairshare)

    def set_fairshare(self, uid: int, value: float, at: float) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO fairshare (uid, value, at) VALUES (?, ?, ?)", (uid, value, at))
        if self._fairshare is not None:  # written: the copy follows
            self._fairshare[uid] = (float(value), float(at))


queued_id = attrgetter("waiter.id")  # a queue row's id: the rows are kept by it


def _queued(row: sqlite3.Row) -> Queued:
    waiter = Waiter(row["id"], row["uid"], row["user"], row["gpus"], row["since"], row["priority"], row["share"])
    terms = json.loads(row["quota"])
    if "slice_profiles" in terms:  # JSON has no tuples
        terms["slice_profiles"] = tuple(terms["slice_profiles"])
    return Queued(waiter, Quota(**terms), Origin(row["origin"]), row["pid"], row["pid_start"],
                  tuple(json.loads(row["counted"])))


def hour_of(t: float) -> int:
    """The start of the UTC hour that contains time t (epoch seconds)."""
    return int(t // HOUR) * HOUR


def _add_usage_total(db: sqlite3.Connection, uid: int, user: str, unit: int, granted: float, busy: float,
                     idle: float, kills: int) -> None:
    db.execute(
        "INSERT INTO usage (uid, user, minor, granted_seconds, busy_seconds, idle_seconds, kills)"
        " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (uid, minor) DO UPDATE SET"
        " granted_seconds = granted_seconds + excluded.granted_seconds,"
        " busy_seconds = busy_seconds + excluded.busy_seconds,"
        " idle_seconds = idle_seconds + excluded.idle_seconds, kills = kills + excluded.kills",
        (uid, user, unit, granted, busy, idle, kills))


def _fields(row: sqlite3.Row) -> dict[str, Any]:
    """A grants or events row as its dataclass's fields. The column keeps the name `minor` that
    every schema version, the frozen databases and the fleet's tables have (renaming it is a
    migration for no reader's benefit); the dataclasses call it `unit`, as it holds one. Here only."""
    fields = dict(row)
    fields["unit"] = fields.pop("minor")
    return fields


def _grant(row: sqlite3.Row) -> Grant:
    return Grant(**{**_fields(row), "shared": bool(row["shared"]), "origin": Origin(row["origin"])})


def _event(row: sqlite3.Row) -> Event:
    return Event(**{**_fields(row), "numbers": json.loads(row["numbers"])})


def _grant_order(grant: Grant) -> tuple[int, int]:
    return (grant.uid, grant.unit)


def _marked_active(grant: Grant, now: float) -> Grant:
    """The grant with last_active = now, its other fields as they are. Built from its fields
    directly: dataclasses.replace costs ten times as much, and the watcher marks every busy
    grant about every ACTIVE_WRITE_EVERY seconds."""
    marked = object.__new__(Grant)
    fields = marked.__dict__
    fields.update(grant.__dict__)
    fields["last_active"] = now
    return marked


def grant_key(grant: Grant) -> tuple[int, int, float]:
    """What makes a grant itself: its user, its unit and when it was given (a later grant of the
    same unit to the same user is another; a mark, which moves only last_active, is the same)."""
    return (grant.uid, grant.unit, grant.granted_at)


class GrantChanges:
    """Grants gone and come, by grant_key: one that comes after it went (or goes after it came)
    cancels out, so these are the difference between two sets of grants."""

    def __init__(self) -> None:
        self._gone: dict[tuple[int, int, float], Grant] = {}
        self._came: dict[tuple[int, int, float], Grant] = {}

    def went(self, grant: Grant) -> None:
        key = grant_key(grant)
        if self._came.pop(key, None) is None:
            self._gone[key] = grant

    def arrived(self, grant: Grant) -> None:
        key = grant_key(grant)
        if self._gone.pop(key, None) is None:
            self._came[key] = grant

    def add(self, later: GrantChanges) -> None:
        """Then `later`'s changes too."""
        for grant in later.gone:
            self.went(grant)
        for grant in later.came:
            self.arrived(grant)

    @property
    def gone(self) -> list[Grant]:
        return list(self._gone.values())

    @property
    def came(self) -> list[Grant]:
        return list(self._came.values())

    def __bool__(self) -> bool:
        return bool(self._gone or self._came)


class _Grants:
    """The store's copy of the grants table: read once, then changed in place by the store's own
    writes, after they committed; `version` moves at each change. The grants by slot, and the slots
    by user and by GPU (a slice's grant on its parent's), so that a mark (only last_active changes)
    replaces one entry; the rows in order are built when first asked for after a change. Once
    take_changes is called, the changes since are kept for the next call (a daemon never calls it,
    and keeps none)."""

    def __init__(self) -> None:
        self.read_once = False
        self.version = 0
        self._by_slot: dict[tuple[int, int], Grant] = {}
        self._of_uid: dict[int, set[int]] = {}  # uid -> its units
        self._on_gpu: dict[int, set[tuple[int, int]]] = {}  # GPU -> the slots on it
        self._order: list[tuple[int, int]] | None = None  # the slots sorted (kept so); None: not since a read
        self._rows: tuple[Grant, ...] | None = None
        self._changes: GrantChanges | None = None  # since the last take_changes; None: not followed

    def read(self, rows: Iterable[sqlite3.Row]) -> None:
        self.read_once = True
        self._put(map(_grant, rows))

    def take_changes(self) -> GrantChanges | None:
        taken = self._changes
        self._changes = GrantChanges()
        return taken

    def put(self, grants: Iterable[Grant]) -> None:
        if self.read_once:
            self._put(grants)

    def drop(self, grants: Iterable[Grant]) -> None:
        if not self.read_once:
            return
        for grant in grants:
            slot = (grant.uid, grant.unit)
            if (gone := self._by_slot.pop(slot, None)) is not None:
                if self._changes is not None:
                    self._changes.went(gone)
                _discard_in(self._of_uid, grant.uid, grant.unit)
                _discard_in(self._on_gpu, unit_parent(grant.unit), slot)
                if self._order is not None:
                    del self._order[bisect.bisect_left(self._order, slot)]
        self._changed()

    def mark_active(self, slots: Iterable[tuple[int, int]], now: float) -> None:
        if not self.read_once:
            return
        by_slot = self._by_slot
        for slot in slots:
            if (grant := by_slot.get(slot)) is not None:
                by_slot[slot] = _marked_active(grant, now)  # the same grant (grant_key): no change to follow
        self._changed()

    def _put(self, grants: Iterable[Grant]) -> None:
        for grant in grants:
            slot = (grant.uid, grant.unit)
            held = self._by_slot.get(slot)
            if held is None:  # a slot held already keeps its place in the indexes
                self._of_uid.setdefault(grant.uid, set()).add(grant.unit)
                self._on_gpu.setdefault(unit_parent(grant.unit), set()).add(slot)
                if self._order is not None:
                    bisect.insort(self._order, slot)
            if self._changes is not None:
                if held is not None:
                    self._changes.went(held)
                self._changes.arrived(grant)
            self._by_slot[slot] = grant
        self._changed()

    def _changed(self) -> None:
        self.version += 1
        self._rows = None

    def rows(self) -> tuple[Grant, ...]:
        if self._rows is None:
            if self._order is None:
                self._order = sorted(self._by_slot)
            self._rows = tuple(map(self._by_slot.__getitem__, self._order))
        return self._rows

    def of_user(self, uid: int) -> list[Grant]:
        return [self._by_slot[(uid, unit)] for unit in sorted(self._of_uid.get(uid, ()))]

    def on_gpu(self, gpu: int) -> list[Grant]:
        return [self._by_slot[slot] for slot in self._on_gpu.get(gpu, ())]


# A change of the queue, (before, after): a row joined (None, row), left (row, None), or changed
# in place (old, new: grown by keep_total, its id and place kept).
QueueChange = tuple["Queued | None", "Queued | None"]
_QUEUE_LOG = 4096  # changes kept for queue_changes: a follower further behind works the queue out afresh


class _Queue:
    """The store's copy of the queue, kept as _Grants is: the rows by id (ids only grow, so a row
    that joined is the last one), and a log of the last changes, each with the version it made."""

    def __init__(self) -> None:
        self.read_once = False
        self.version = 0
        self.rows: tuple[Queued, ...] = ()
        self._log: collections.deque[tuple[int, QueueChange]] = collections.deque(maxlen=_QUEUE_LOG)

    def read(self, rows: tuple[Queued, ...]) -> None:
        self.read_once, self.rows = True, rows

    def joined(self, queued: Queued) -> None:
        if self.read_once:
            self.rows = (*self.rows, queued)
            self._logged((None, queued))

    def left(self, ids: Iterable[int]) -> None:
        if not self.read_once:
            return
        rows = self.rows
        for gone in sorted(ids):  # found by id (the rows are by id) and cut out: no step per row kept
            at = bisect.bisect_left(rows, gone, key=queued_id)
            if at < len(rows) and rows[at].waiter.id == gone:
                self._logged((rows[at], None))
                rows = rows[:at] + rows[at + 1:]
        self.rows = rows

    def regrown(self, before: Queued, after: Queued) -> None:
        if self.read_once:
            self.rows = tuple(after if q.waiter.id == after.waiter.id else q for q in self.rows)
            self._logged((before, after))

    def _logged(self, change: QueueChange) -> None:
        self.version += 1
        self._log.append((self.version, change))

    def changes(self, since: int) -> list[QueueChange] | None:
        if since == self.version:
            return []
        if not self._log or self._log[0][0] > since + 1:
            return None  # the log no longer reaches back that far
        # The versions are consecutive: the changes wanted are the last `version - since`, read
        # from the end (a scan of the whole log at every call was a third of a month's replay).
        newer = [change for _, change in itertools.islice(reversed(self._log), self.version - since)]
        newer.reverse()
        return newer


def _discard_in(index: dict[Any, set[Any]], key: object, member: object) -> None:
    """Take `member` out of index[key], and the key with its last member."""
    members = index[key]
    members.discard(member)
    if not members:
        del index[key]


def _session(row: sqlite3.Row) -> Session:
    # caller_start is the daemon's own business (liveness), not part of what a session shows.
    return Session(**{key: row[key] for key in row.keys() if key != "caller_start"})


class _Sessions:
    """The store's copy of the sessions table, kept as _Grants is: read once, changed by the
    store's own writes after they committed. Sessions by id, with their caller's start time, and
    the ids by user; the rows in order are built when first asked for after a change."""

    def __init__(self) -> None:
        self.read_once = False
        self._by_id: dict[int, tuple[Session, int | None]] = {}  # id -> the session, its caller_start
        self._of_uid: dict[int, set[int]] = {}  # uid -> its session ids
        self._by_caller: dict[tuple[int, int], set[int]] = {}  # (uid, PAM caller pid) -> its session ids
        self._ttys: dict[int, Counter[str]] = {}  # uid -> its sessions' terminals, how many each
        self._rows: tuple[Session, ...] | None = None

    def read(self, rows: Iterable[sqlite3.Row]) -> None:
        self.read_once = True
        for row in rows:
            self._put(_session(row), row["caller_start"])

    def put(self, session: Session, caller_start: int | None) -> None:
        if self.read_once:
            self._put(session, caller_start)

    def _put(self, session: Session, caller_start: int | None) -> None:
        self._by_id[session.id] = (session, caller_start)
        self._of_uid.setdefault(session.uid, set()).add(session.id)
        self._by_caller.setdefault((session.uid, session.pid), set()).add(session.id)
        self._ttys.setdefault(session.uid, Counter())[session.tty] += 1
        self._rows = None

    def drop(self, ids: Iterable[int]) -> None:
        if not self.read_once:
            return
        for id_ in ids:
            if (dropped := self._by_id.pop(id_, None)) is not None:
                session = dropped[0]
                _discard_in(self._of_uid, session.uid, id_)
                _discard_in(self._by_caller, (session.uid, session.pid), id_)
                ttys = self._ttys[session.uid]
                ttys[session.tty] -= 1
                if not ttys[session.tty]:
                    del ttys[session.tty]
                if not ttys:
                    del self._ttys[session.uid]
        self._rows = None

    def rows(self) -> tuple[Session, ...]:
        if self._rows is None:
            self._rows = tuple(self._by_id[id_][0] for id_ in sorted(self._by_id))
        return self._rows

    def of_user(self, uid: int) -> list[Session]:
        return [self._by_id[id_][0] for id_ in sorted(self._of_uid.get(uid, ()))]

    def has_user(self, uid: int) -> bool:
        return uid in self._of_uid

    def uids(self) -> set[int]:
        return set(self._of_uid)

    def newest_of(self, uid: int, pid: int) -> Session | None:
        """uid's newest session opened by the PAM caller pid."""
        ids = self._by_caller.get((uid, pid))
        return self._by_id[max(ids)][0] if ids else None

    def ttys_of(self, uid: int) -> list[str]:
        return sorted(self._ttys.get(uid, ()))

    def caller_starts(self) -> dict[int, int | None]:
        return {id_: caller_start for id_, (_, caller_start) in self._by_id.items()}


_BUCKET_COLUMNS = "step, kind, key, slot, start, n, util_n, util_sum, util_peak, mem_sum, mem_peak, total"
# usage_by's groupings: fixed SQL, never built from input. A user is keyed by name (the name
# written with the rows), so a report still shows accounts deleted since.
_GROUP_KEYS = {"user": "user", "gpu": "minor", "day": "date(hour, 'unixepoch', 'localtime')"}


def _filters(**equal: object) -> tuple[list[str], list[object]]:
    """`column = ?` conditions for the filters given (None: not filtered)."""
    given = {column: value for column, value in equal.items() if value is not None}
    return [f"{column} = ?" for column in given], list(given.values())


def _where(conditions: list[str]) -> str:
    return "WHERE " + " AND ".join(conditions) if conditions else ""


def _rows_of(table: str, uid: int | None) -> tuple[str, tuple[int, ...]]:
    """SELECT of a table's rows, of one user's only when uid is given; the caller adds the order."""
    if uid is None:
        return f"SELECT * FROM {table}", ()
    return f"SELECT * FROM {table} WHERE uid = ?", (uid,)


def _row_id(cursor: sqlite3.Cursor) -> int:
    """The id an INSERT just gave its row (set after every successful INSERT)."""
    assert cursor.lastrowid is not None
    return cursor.lastrowid
