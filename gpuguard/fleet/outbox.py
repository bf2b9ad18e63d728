"""The node's outbox: the ended grants (the usage ledger), kept until the fleet database has them.

A SQLite file of its own next to the state database (fleet.db), so a node keeps its ledger
across a database outage and a restart. Rows go out with the next heartbeat and are marked
confirmed once it succeeded; the database keys them by (node, incarnation, seq) and ignores a
row it has, so a heartbeat lost after it committed replays nothing twice. A confirmed row is
kept for KEEP_CONFIRMED, because a commit the leader had not yet replicated is lost when a
replica is promoted: on each new connection the node asks the database which of the kept rows
it has (fleetdb.FleetDb.heartbeat), and the others are pending again (resend_absent). A
failover, a switchover done in the wrong order or a promoted replica that lagged (its timeline
may even carry the same number as the lost leader's) loses no ledger row. `seq` is
AUTOINCREMENT (never reused, even after deletes) and `incarnation` is drawn when the file is
made, so a state directory made again does not collide with the rows of the one before.
"""
from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpuguard.core.model import Grant

BATCH = 1000  # ledger rows per heartbeat: a long outage is replayed over several
KEEP_CONFIRMED = 86400.0  # seconds a confirmed row is kept, to be sent again to a database that lacks it


class Outbox:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._db = sqlite3.connect(path, isolation_level=None, timeout=10)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS ledger (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                         " username TEXT NOT NULL, minor INTEGER NOT NULL, started REAL NOT NULL, ended REAL NOT NULL)")
        columns = {row["name"] for row in self._db.execute("PRAGMA table_info(ledger)")}
        if "confirmed_at" not in columns:  # an outbox of a release before: every row still pending
            self._db.execute("ALTER TABLE ledger ADD COLUMN confirmed_at REAL")
        self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('incarnation', ?)", (secrets.token_hex(8),))
        self.incarnation: str = self._db.execute("SELECT value FROM meta WHERE key = 'incarnation'").fetchone()[0]

    def add(self, ended: Iterable[Grant], now: float) -> None:
        """Grants taken back at `now`: one ledger row each (GPU-seconds from granted_at to now)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("INSERT INTO ledger (username, minor, started, ended) VALUES (?, ?, ?, ?)",
                                 [(g.user, g.unit, g.granted_at, now) for g in ended])

    def pending(self, limit: int = BATCH) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT seq, username, minor, started, ended FROM ledger WHERE confirmed_at IS NULL"
                                " ORDER BY seq LIMIT ?", (limit,))
        return [dict(row) for row in rows]

    def confirm(self, upto: int, now: float) -> None:
        """The database has every row up to seq `upto`; rows confirmed more than KEEP_CONFIRMED ago go."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("UPDATE ledger SET confirmed_at = ? WHERE seq <= ? AND confirmed_at IS NULL", (now, upto))
            self._db.execute("DELETE FROM ledger WHERE confirmed_at < ?", (now - KEEP_CONFIRMED,))

    def kept_from(self) -> int | None:
        """The first row kept (None: none): a new connection asks the database about the rows from
        there on. Pending rows too: a heartbeat carrying a row sent again, older than every row still
        confirmed, must find it in the answer, or it would be sent again at every connection."""
        first: int | None = self._db.execute("SELECT min(seq) FROM ledger").fetchone()[0]
        return first

    def resend_absent(self, present: Iterable[int]) -> int:
        """The database has the rows `present` of those from kept_from() on: the confirmed rows it
        lacks are pending again; how many."""
        have = set(present)
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            absent = [(row[0],) for row in self._db.execute("SELECT seq FROM ledger WHERE confirmed_at IS NOT NULL")
                      if row[0] not in have]
            self._db.executemany("UPDATE ledger SET confirmed_at = NULL WHERE seq = ?", absent)
        return len(absent)

    def count(self) -> int:
        """Rows the database has not confirmed yet."""
        count: int = self._db.execute("SELECT count(*) FROM ledger WHERE confirmed_at IS NULL").fetchone()[0]
        return count

    def close(self) -> None:
        self._db.close()
