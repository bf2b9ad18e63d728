"""The fleet database's edge: connections, migrations and the calls the node makes (psycopg 3).

Every call is one round trip: the heartbeat and the grant-time check are server-side
functions (schema.py) taking one JSON document, the view one SELECT. Connections run in
autocommit, so a call is its own transaction without BEGIN and COMMIT round trips.
The grant-time check (with the releases sent before it) commits without waiting for the WAL
to reach disk (synchronous_commit off for its transaction only): a login then waits for no disk
flush on the database server. Others see it at once all the same; what a crash of the database
server can lose of it (its last fraction of a second) the nodes send again before they
check anything there, since a crash drops every connection, puts each node offline, and only
a heartbeat, which carries the node's whole truth, brings it back online. A heartbeat that
writes more than last_seen keeps the default, and the first heartbeat on each new connection
asks which of the node's kept ledger rows the database has (outbox.py: a promoted replica may
lack what the lost leader confirmed).
Waits are bounded on both sides: libpq's connect_timeout and tcp_user_timeout on the
client, statement_timeout and lock_timeout on the server.
Each new connection is fenced before anything is written (fencing.py): a standby, another
database or an old leader is refused. A schema dropped under a running node is made again by
its next connection.
A node may log in under its own role (roles.py): every write is then one of the schema's
functions that check the caller writes only its own rows, and the migrations are the owner's.
A heartbeat sends only the parts of the node's truth (its GPUs, grants, queue) that changed
since this connection's last, with the digest the database then has (schema.py, migration 6):
it writes the node's last_seen and those parts, and nothing else. The grants go after this
node's own grant-time check or release too; the whole truth on each new connection, once
FULL_EVERY, and when the database asks for it (the digest it has is not the one the node says).
Grants taken back are released in front of the next call (the heartbeat they ask for, or a
grant-time check that comes first), pipelined into its round trip: the check would otherwise
find their GPUs still granted there. A release kept survives a dropped connection.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from gpuguard.fleet.fencing import Fenced, Lineage, LineageMemory, refusal, timeline_of
from gpuguard.fleet.schema import CURRENT, LOCK_KEY, MIGRATIONS, NAMESPACE, FleetError

STATEMENT_TIMEOUT_MS = 5000  # the heartbeat of a node with thousands of ledger rows to replay included
LOCK_TIMEOUT_MS = 2000       # a user's quota row held longer than this by another check: give up
CONNECT_TIMEOUT_S = 2        # libpq's minimum that means something (it rounds smaller values up to 2)
# Selected in a statement, its transaction commits without waiting for the WAL flush (is_local:
# for this transaction only; the commit reads the setting before it is undone).
UNFLUSHED = "set_config('synchronous_commit', 'off', true)"
FULL_EVERY = 60.0  # seconds: a heartbeat sends the node's whole truth at least this often
# What a heartbeat mirrors, which its digest covers: the node row's fields, and its GPUs, grants and queue.
FIELDS = ("node", "host", "install", "rack", "ssh", "version", "schema", "incarnation", "heartbeat", "lease", "grace")
PARTS = ("gpus", "grants", "queue")
# What a heartbeat that sends only what changed sends besides (schema.py, heartbeat_v5 and heartbeat_v6)
ALWAYS = ("node", "incarnation", "taken_at", "half_life", "ledger", "usage_for", "users", "want_free", "usage_all")


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class Sent:
    """What a connection's last heartbeat for a node left in the database: its digest, each part's
    (None: to be sent again), and when the whole truth last went."""
    digest: str
    parts: dict[str, str | None]
    whole_at: float


# Where a session looks up what its statements name without a schema: the system's only. Every
# name of gpuguard's is written with its schema; anything else found first in schema public (which
# PUBLIC may create in up to PostgreSQL 14) would run with the session's rights: a node's role made
# the owner run its own format() in a migration and the admin its to_jsonb() in `fleet remove`.
# And a connection that a cut network broke is given up on both sides alike, libpq's (in
# connection_options) and the server's: left to the kernel's default the server's side stays two
# hours, counting against the role's CONNECTION LIMIT (roles.py), and two cuts would keep a node out.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT, USER_TIMEOUT_MS = 5, 2, 2, 5000
SESSION_OPTIONS = (f"-c search_path=pg_catalog,pg_temp -c tcp_keepalives_idle={KEEPALIVE_IDLE_S}"
                   f" -c tcp_keepalives_interval={KEEPALIVE_INTERVAL_S} -c tcp_keepalives_count={KEEPALIVE_COUNT}"
                   f" -c tcp_user_timeout={USER_TIMEOUT_MS}")


def connection_options(node: str) -> dict[str, Any]:
    """libpq keywords added to the admin's connection string: bounded waits on both sides, the
    system's names only, and a name in pg_stat_activity."""
    return {"connect_timeout": CONNECT_TIMEOUT_S, "application_name": f"gpuguard {node}"[:63],
            "tcp_user_timeout": USER_TIMEOUT_MS, "keepalives": 1, "keepalives_idle": KEEPALIVE_IDLE_S,
            "keepalives_interval": KEEPALIVE_INTERVAL_S, "keepalives_count": KEEPALIVE_COUNT,
            "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c lock_timeout={LOCK_TIMEOUT_MS} {SESSION_OPTIONS}"}


def connect(conninfo: str, node: str) -> psycopg.Connection:
    return psycopg.connect(conninfo, autocommit=True, **connection_options(node))


# The database a connection reached: a standby (True), its system identifier and, on a leader,
# its WAL file, whose name starts with the current timeline.
LINEAGE = ("SELECT pg_is_in_recovery(), (SELECT system_identifier FROM pg_control_system())::text,"
           " CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_walfile_name(pg_current_wal_lsn()) END")
# What a schema dropped under a running node raises: its next connection migrates again.
SCHEMA_GONE = (psycopg.errors.InvalidSchemaName, psycopg.errors.UndefinedFunction, psycopg.errors.UndefinedTable)


def lineage_of(conn: psycopg.Connection) -> Lineage:
    """Which database, and which leader of it, `conn` reached; Fenced for a standby."""
    row = conn.execute(LINEAGE).fetchone()
    assert row is not None
    standby, system, wal_file = row
    if standby:
        raise Fenced("fenced: the fleet database reached is a standby (read-only): nothing written there; "
                     "list the leader first, or add target_session_attrs=read-write to [fleet] database")
    return Lineage(system, timeline_of(wal_file))


def check_fence(conn: psycopg.Connection, memory: LineageMemory) -> None:
    """Fenced unless this node may write to the database `conn` reached (a reader's check: it
    remembers nothing)."""
    if why := refusal(memory.remembered(), lineage_of(conn)):
        raise Fenced(why)


def fence(conn: psycopg.Connection, memory: LineageMemory) -> Lineage:
    """The lineage of the database `conn` reached, once this node may write there (Fenced
    otherwise); a later leader (or the first database) is remembered from now on."""
    seen, remembered = lineage_of(conn), memory.remembered()
    if why := refusal(remembered, seen):
        raise Fenced(why)
    if seen != remembered:
        memory.remember(seen)
    return seen


def migrate(conn: psycopg.Connection, node: str) -> int:
    """Bring the database to this node's schema (what is missing of it), under an advisory lock;
    returns the database's version. Raises FleetError when an applied migration needs a newer node,
    or when one is missing and this connection's role may not apply it (a node's own role,
    roles.py: the owner applies migrations, with `gpuguard fleet init`). A database that has them
    all is only read."""
    applied = _applied(conn)
    if applied is None or any(migration.version not in applied for migration in MIGRATIONS):
        try:
            applied = _apply(conn, node)
        except psycopg.errors.InsufficientPrivilege:
            missing = [m.version for m in MIGRATIONS if applied is None or m.version not in applied]
            role = conn.info.user
            raise FleetError(f"the fleet database lacks schema {missing[0]}, and this node's role {role} may not "
                             f"create it: run `sudo gpuguard fleet init --database OWNER` once with the schema "
                             f"owner's connection string (it migrates), then restart") from None
    needed = max(applied.values())
    if needed > CURRENT:
        raise FleetError(f"the fleet database needs gpuguard schema {needed} or newer; this node has {CURRENT}: "
                           "upgrade gpuguard on this node")
    return max(applied)


def _applied(conn: psycopg.Connection) -> dict[int, int] | None:
    """The migrations applied (version: min_node); None when there is no migrations table (or this
    role may not see the schema)."""
    try:
        row = conn.execute(f"SELECT to_regclass('{NAMESPACE}.migrations') IS NOT NULL").fetchone()
        if row is None or not row[0]:
            return None
        return dict(conn.execute(f"SELECT version, min_node FROM {NAMESPACE}.migrations").fetchall())
    except psycopg.errors.InsufficientPrivilege:
        return None


def _apply(conn: psycopg.Connection, node: str) -> dict[int, int]:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {NAMESPACE}")
        conn.execute(f"CREATE TABLE IF NOT EXISTS {NAMESPACE}.migrations (version integer PRIMARY KEY,"
                     " min_node integer NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(), node text NOT NULL)")
        applied = dict(conn.execute(f"SELECT version, min_node FROM {NAMESPACE}.migrations").fetchall())
        for migration in MIGRATIONS:
            if migration.version not in applied:
                conn.execute(migration.sql)
                conn.execute(f"INSERT INTO {NAMESPACE}.migrations (version, min_node, node) VALUES (%s, %s, %s)",
                             (migration.version, migration.min_node, node))
                applied[migration.version] = migration.min_node
    return applied


def _answer(cursor: psycopg.Cursor[Any]) -> dict[str, Any]:
    """The jsonb a node function returned (the row's last column), which psycopg loads as a dict."""
    row = cursor.fetchone()
    assert row is not None
    answer: dict[str, Any] = row[-1]
    return answer


class FleetDb:
    """The node's own connection, used from one thread at a time (the service's worker): opened
    and migrated on first use, dropped after any error and opened again by the next call, so a
    promoted standby (a multi-host connection string) is found without a restart."""

    def __init__(self, conninfo: str, node: str, memory: LineageMemory | None = None):
        """memory: the database this node has written to (fencing); None: not fenced (a tool's)."""
        self.conninfo = conninfo
        self.node = node
        self.memory = memory
        self.lineage: Lineage | None = None  # of the database the current connection reached
        self._conn: psycopg.Connection | None = None
        self._migrated = False
        self._ledger_checked = False  # on this connection: the heartbeat asked which ledger rows it has
        # On this connection, by node (a daemon sends for its own; the bench for many): what its
        # last heartbeat left in the database.
        self._sent: dict[str, Sent] = {}
        # Grants taken back that the database may still have (release): sent in front of the next
        # call, in its round trip.
        self._unreleased: list[tuple[int, str]] = []

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            conn = connect(self.conninfo, self.node)
            try:
                self.lineage = fence(conn, self.memory) if self.memory is not None else None
                if not self._migrated:
                    migrate(conn, self.node)
                    self._migrated = True
            except BaseException:
                conn.close()
                raise
            self._conn, self._ledger_checked, self._sent = conn, False, {}
        return self._conn

    def _failed(self, exc: psycopg.Error) -> None:
        """After any error the connection is dropped; a schema gone is made again by the next."""
        if isinstance(exc, SCHEMA_GONE):
            self._migrated = False
        self.close()

    def _execute(self, query: str, params: tuple[Any, ...]) -> psycopg.Cursor[Any]:
        """One statement on the node's connection; raises psycopg.Error, the connection dropped."""
        try:
            return self._connection().execute(query, params)
        except psycopg.Error as exc:
            self._failed(exc)
            raise

    def call(self, function: str, doc: dict[str, Any], flushed: bool = True) -> dict[str, Any]:
        """SELECT gpuguard.<function>(doc): one round trip; raises psycopg.Error (the connection is
        dropped). flushed=False: the commit does not wait for the WAL flush (the module's docstring)."""
        query = f"SELECT {NAMESPACE}.{function}(%s)" if flushed else f"SELECT {UNFLUSHED}, {NAMESPACE}.{function}(%s)"
        pairs = self._unreleased
        try:
            conn = self._connection()
            # the releases kept first, pipelined: one round trip; a check then finds their GPUs free
            with conn.pipeline() if pairs else contextlib.nullcontext():
                if pairs:
                    conn.execute(f"SELECT {UNFLUSHED}, {NAMESPACE}.release_v1(%s, %s::integer[], %s::text[])",
                                 (self.node, [minor for minor, _ in pairs], [user for _, user in pairs]))
                called = conn.execute(query, (Jsonb(doc),))
            answer = _answer(called)
        except psycopg.Error as exc:
            self._failed(exc)
            raise
        self._unreleased = []
        return answer

    def heartbeat(self, doc: dict[str, Any], kept_from: int | None = None) -> dict[str, Any]:
        """The heartbeat's answer; the first on a connection adds `ledger_present`, the seqs from
        `kept_from` on of this node's outbox (doc's incarnation) that the database has (none kept: not asked).
        Only the parts that changed since this connection's last heartbeat (the module's docstring)."""
        parts: dict[str, str | None] = {"fields": _hash([doc.get(key) for key in FIELDS]),
                                        **{part: _hash(doc[part]) for part in PARTS}}
        digest, node, now = _hash(parts), doc["node"], time.monotonic()
        answer, sent = None, self._sent.get(node)
        if sent is not None and sent.parts["fields"] == parts["fields"] and now < sent.whole_at + FULL_EVERY:
            changed = {part: doc[part] for part in PARTS if sent.parts[part] != parts[part]}
            # one that only says "still here" need not reach disk: a crash loses a last_seen the next rewrites
            answer = self.call("heartbeat_v6", {**{k: doc[k] for k in ALWAYS if k in doc}, **changed,
                                                "since": sent.digest, "digest": digest},
                               flushed=bool(changed or doc.get("ledger")))
            if not answer.get("resend"):
                self._sent[node] = Sent(digest, parts, sent.whole_at)
        if answer is None or answer.get("resend"):
            # whole: the offline budget's users are asked about too (FleetNode.snapshot)
            whole = {k: v for k, v in doc.items() if k != "budget_users"}
            whole["users"] = sorted({*doc.get("users", ()), *doc.get("budget_users", ())})
            answer = self.call("heartbeat_v5", {**whole, "digest": digest})
            if "refused" in answer:
                self._sent.pop(node, None)
            else:
                self._sent[node] = Sent(digest, parts, now)
        if not self._ledger_checked:
            if kept_from is not None:
                answer["ledger_present"] = self._ledger_seqs(doc["incarnation"], kept_from)
            self._ledger_checked = True
        return answer

    def _ledger_seqs(self, incarnation: str, kept_from: int) -> list[int]:
        rows = self._execute(f"SELECT seq FROM {NAMESPACE}.ledger WHERE node = %s AND incarnation = %s AND seq >= %s",
                             (self.node, incarnation, kept_from)).fetchall()
        return [seq for (seq,) in rows]

    def reserve(self, doc: dict[str, Any]) -> dict[str, Any]:
        self._grants_changed()
        return self.call("reserve_v3", doc, flushed=False)

    def release(self, pairs: list[tuple[int, str]]) -> None:
        """Grants of this node taken back: (minor, user) each, sent in front of the next call,
        heartbeat or check, in its round trip (call)."""
        self._grants_changed()
        self._unreleased.extend(pairs)

    def _grants_changed(self) -> None:
        """This node's grants in the database change (or may, when the call fails): the next
        heartbeat sends them, whatever the node's own say."""
        for sent in self._sent.values():
            sent.parts["grants"] = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# Every node, its GPUs with their holders, and its queue depth: what `status --fleet` and
# `gpuguard where` show, in one statement.
VIEW = f"""
SELECT n.name AS node, n.rack, n.ssh, n.version, n.first_seen, n.last_seen, n.heartbeat, n.lease, n.grace,
       g.minor, g.uuid, g.name AS gpu_name, g.memory_total, g.owner,
       coalesce(h.holders, ARRAY[]::text[]) AS holders, coalesce(h.shared, false) AS shared,
       coalesce(q.waiting, 0) AS queued, coalesce(q.gpus, 0) AS queued_gpus,
       extract(epoch FROM clock_timestamp()) AS now
FROM {NAMESPACE}.nodes n
LEFT JOIN {NAMESPACE}.gpus g ON g.node = n.name
LEFT JOIN LATERAL (SELECT array_agg(r.username ORDER BY r.username) AS holders, bool_and(r.shared) AS shared
                   FROM {NAMESPACE}.grants r WHERE r.node = g.node AND r.minor = g.minor) h ON true
LEFT JOIN (SELECT node, count(*) AS waiting, sum(gpus) AS gpus FROM {NAMESPACE}.queue GROUP BY node) q
       ON q.node = n.name
ORDER BY n.name, g.minor
"""


def remove_node(conn: psycopg.Connection, name: str, force: bool = False) -> dict[str, Any] | None:
    """Take node `name` out of the fleet database, in one transaction: its row and with it (ON
    DELETE CASCADE) its GPUs, grants and queue; None when there is none of that name. While its
    grants still count (seen within lease + grace: a running node, or one cut off for a moment,
    would only register again) nothing is changed (`removed` false) unless `force`.
    Its ledger rows stay: they are its users' usage, which fair share counts on every server
    until it decays (dropping them would put whoever worked there first in every queue); a name
    used again is a new install, whose rows its outbox's incarnation keys apart. The row is read
    whole (to_jsonb), so a database of any schema version does."""
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cursor:
        row = cursor.execute(
            f"SELECT to_jsonb(n) AS node, extract(epoch FROM clock_timestamp()) AS now,"
            f" (SELECT count(*) FROM {NAMESPACE}.gpus g WHERE g.node = n.name) AS gpus,"
            f" (SELECT count(*) FROM {NAMESPACE}.grants g WHERE g.node = n.name) AS grants,"
            f" (SELECT count(*) FROM {NAMESPACE}.queue q WHERE q.node = n.name) AS queued,"
            f" (SELECT count(*) FROM {NAMESPACE}.ledger l WHERE l.node = n.name) AS ledger"
            f" FROM {NAMESPACE}.nodes n WHERE n.name = %s FOR UPDATE", (name,)).fetchone()
        if row is None:
            return None
        node = row["node"]
        silent = float(row["now"]) - float(node["last_seen"])
        live = not silent > float(node["lease"]) + float(node["grace"])  # NaN (a row before schema 3): live
        found = {"node": name, "removed": force or not live, "live": live, "host": node.get("host", ""),
                 "install": node.get("identity", ""), "silent_for": silent, "lease": float(node["lease"]),
                 "grace": float(node["grace"]), "gpus": row["gpus"], "grants": row["grants"],
                 "queued": row["queued"], "ledger": row["ledger"]}
        if found["removed"]:
            cursor.execute(f"DELETE FROM {NAMESPACE}.nodes WHERE name = %s", (name,))
    return found


def view(conn: psycopg.Connection) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cursor:
        return cursor.execute(VIEW).fetchall()
