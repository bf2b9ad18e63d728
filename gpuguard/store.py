"""SQLite state: the source of truth for grants, sessions, events and usage.

WAL with synchronous=FULL and one transaction per change: a crash (even SIGKILL in the
middle of a write) loses no committed grant and leaves no half-written one. The gate map
and device ACLs are derived from this and rebuilt from it at daemon start.
"""
from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuguard.model import Event, Grant, Session
from gpuguard.errors import GpuguardError

# Ordered migrations: index i brings the schema from version i to i + 1. Never edit a
# released entry; append a new one.
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
    # When each user last gave back each GPU: a returning user gets the same ones (allocator).
    """
    CREATE TABLE held_last (
        uid INTEGER NOT NULL, minor INTEGER NOT NULL, released_at REAL NOT NULL,
        PRIMARY KEY (uid, minor));
    """,
)


class StoreError(GpuguardError):
    """The state database cannot be opened or is from a newer gpuguard."""


class Store:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per change.
        self._db = sqlite3.connect(self.path, isolation_level=None, timeout=10)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        self._db.close()

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

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
        return self._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    # --- grants

    def add_grants(self, uid: int, user: str, minors: Iterable[int], now: float,
                   expires_at: float | None, shared: bool = False, origin: str = "session") -> None:
        with self.transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO grants (uid, user, minor, granted_at, expires_at, last_active, shared, origin)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(uid, user, minor, now, expires_at, now, int(shared), origin) for minor in minors])

    def grants(self, uid: int | None = None) -> list[Grant]:
        query, params = _rows_of("grants", uid)
        return [_grant(row) for row in self._db.execute(query + " ORDER BY uid, minor", params)]

    def remove_grants(self, uid: int, minors: Iterable[int] | None, now: float) -> list[Grant]:
        """Remove a user's grants (all, or those minors); returns what was removed."""
        with self.transaction() as db:
            held = [_grant(row) for row in db.execute("SELECT * FROM grants WHERE uid = ?", (uid,))]
            wanted = set(minors) if minors is not None else None
            removed = [g for g in held if wanted is None or g.minor in wanted]
            db.executemany("DELETE FROM grants WHERE uid = ? AND minor = ?", [(g.uid, g.minor) for g in removed])
            db.executemany("INSERT OR REPLACE INTO gpu_history (minor, last_released) VALUES (?, ?)",
                           [(g.minor, now) for g in removed])
            db.executemany("INSERT OR REPLACE INTO held_last (uid, minor, released_at) VALUES (?, ?, ?)",
                           [(g.uid, g.minor, now) for g in removed])
        return removed

    def mark_active(self, uid: int, minors: Iterable[int], now: float) -> None:
        with self.transaction() as db:
            db.executemany("UPDATE grants SET last_active = ? WHERE uid = ? AND minor = ?",
                           [(now, uid, minor) for minor in minors])

    def last_held(self, uid: int) -> dict[int, float]:
        """When this user last gave back each GPU they ever held (for sticky allocation)."""
        return {row[0]: row[1] for row in
                self._db.execute("SELECT minor, released_at FROM held_last WHERE uid = ?", (uid,))}

    def last_released(self) -> dict[int, float]:
        """When each GPU was last given back (for least-recently-used allocation)."""
        return {row[0]: row[1] for row in self._db.execute("SELECT minor, last_released FROM gpu_history")}

    # --- sessions

    def open_session(self, uid: int, user: str, service: str, rhost: str, tty: str, pid: int,
                     now: float, caller_start: int | None = None) -> Session:
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO sessions (uid, user, service, rhost, tty, pid, opened_at, caller_start)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (uid, user, service, rhost, tty, pid, now, caller_start))
        return Session(cursor.lastrowid, uid, user, service, rhost, tty, pid, now)

    def close_session(self, uid: int, pid: int) -> Session | None:
        """Close the newest open session of uid opened by the PAM caller pid."""
        with self.transaction() as db:
            row = db.execute("SELECT * FROM sessions WHERE uid = ? AND pid = ? ORDER BY id DESC LIMIT 1",
                             (uid, pid)).fetchone()
            if row is not None:
                db.execute("DELETE FROM sessions WHERE id = ?", (row["id"],))
        return _session(row) if row is not None else None

    def remove_sessions(self, ids: Iterable[int]) -> None:
        with self.transaction() as db:
            db.executemany("DELETE FROM sessions WHERE id = ?", [(i,) for i in ids])

    def sessions(self, uid: int | None = None) -> list[Session]:
        query, params = _rows_of("sessions", uid)
        return [_session(row) for row in self._db.execute(query + " ORDER BY id", params)]

    def caller_starts(self) -> dict[int, int | None]:
        """Session id -> the start time of its PAM caller (None when unknown)."""
        return {row[0]: row[1] for row in self._db.execute("SELECT id, caller_start FROM sessions")}

    # --- events

    def add_event(self, event: Event) -> int:
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO events (time, uid, user, kind, message, minor, pid, command, rule, action, numbers)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (event.time, event.uid, event.user, event.kind, event.message, event.minor, event.pid,
                 event.command, event.rule, event.action, json.dumps(event.numbers)))
        return cursor.lastrowid

    def events(self, uid: int | None = None, limit: int = 50) -> list[Event]:
        """The newest events (of one user, or all), oldest first."""
        query, params = _rows_of("events", uid)
        rows = self._db.execute(query + " ORDER BY id DESC LIMIT ?", (*params, limit)).fetchall()
        return [Event(**{**dict(row), "numbers": json.loads(row["numbers"])}) for row in reversed(rows)]

    # --- usage accounting

    def add_usage(self, uid: int, user: str, minor: int, granted: float = 0.0, busy: float = 0.0,
                  idle: float = 0.0, kills: int = 0) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO usage (uid, user, minor, granted_seconds, busy_seconds, idle_seconds, kills)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (uid, minor) DO UPDATE SET"
                " granted_seconds = granted_seconds + excluded.granted_seconds,"
                " busy_seconds = busy_seconds + excluded.busy_seconds,"
                " idle_seconds = idle_seconds + excluded.idle_seconds, kills = kills + excluded.kills",
                (uid, user, minor, granted, busy, idle, kills))

    def usage(self, uid: int | None = None) -> list[dict]:
        query, params = _rows_of("usage", uid)
        return [dict(row) for row in self._db.execute(query + " ORDER BY uid, minor", params)]


def _grant(row: sqlite3.Row) -> Grant:
    return Grant(**{**dict(row), "shared": bool(row["shared"])})


def _session(row: sqlite3.Row) -> Session:
    # caller_start is the daemon's own business (liveness), not part of what a session shows.
    return Session(**{key: row[key] for key in row.keys() if key != "caller_start"})


def _rows_of(table: str, uid: int | None) -> tuple[str, tuple]:
    """SELECT of a table's rows, of one user's only when uid is given; the caller adds the order."""
    if uid is None:
        return f"SELECT * FROM {table}", ()
    return f"SELECT * FROM {table} WHERE uid = ?", (uid,)
