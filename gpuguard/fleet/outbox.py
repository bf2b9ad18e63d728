"""The node's outbox: the ended grants (the usage ledger) the fleet database has not confirmed yet.

A SQLite file of its own next to the state database (fleet.db), so a node keeps its ledger
across a database outage and a restart. Rows go out with the next heartbeat and are deleted
once it succeeded; the database keys them by (node, incarnation, seq) and ignores a row it has,
so a heartbeat lost after it committed replays nothing twice. `seq` is AUTOINCREMENT (never
reused, even after deletes) and `incarnation` is drawn when the file is made, so a state
directory made again does not collide with the rows of the one before.
"""
from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpuguard.core.model import Grant

BATCH = 1000  # ledger rows per heartbeat: a long outage is replayed over several


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
        self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('incarnation', ?)", (secrets.token_hex(8),))
        self.incarnation: str = self._db.execute("SELECT value FROM meta WHERE key = 'incarnation'").fetchone()[0]

    def add(self, ended: Iterable[Grant], now: float) -> None:
        """Grants taken back at `now`: one ledger row each (GPU-seconds from granted_at to now)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("INSERT INTO ledger (username, minor, started, ended) VALUES (?, ?, ?, ?)",
                                 [(g.user, g.unit, g.granted_at, now) for g in ended])

    def pending(self, limit: int = BATCH) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT seq, username, minor, started, ended FROM ledger ORDER BY seq LIMIT ?", (limit,))
        return [dict(row) for row in rows]

    def confirm(self, upto: int) -> None:
        """The database has every row up to seq `upto`."""
        self._db.execute("DELETE FROM ledger WHERE seq <= ?", (upto,))

    def count(self) -> int:
        count: int = self._db.execute("SELECT count(*) FROM ledger").fetchone()[0]
        return count

    def close(self) -> None:
        self._db.close()
