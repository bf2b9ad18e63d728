"""The fleet database as the web view's source: issue 21's PostgreSQL schema `gpuguard`.

Every node's GPUs (and who owns them: gpuguard, Slurm, Kubernetes), its grants and its queue, as
the nodes' heartbeats mirror them; a user's grants and queue places across the fleet; GPU-hours
granted per user, GPU, node and day from the usage ledger plus the grants still held. The
database knows no processes, memory or utilisation (a node keeps those), so the grid shows them
as unknown, never as idle; nor busy hours (the ledger records grants): the usage charts then
show granted hours alone. Nor fair share (each node's decayed usage, shares and half-life stay
on the node): the Me page says so. A node silent past its lease is shown with what it last sent,
marked lost. Read-only (as the web's own role where there is one, FleetSource): each question is
one short autocommit connection in a worker thread (the web's memo asks at most once a second per
question), with libpq's and the server's timeouts.
"""
from __future__ import annotations

import asyncio
import datetime
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard.core.messages import clock
from gpuguard.core.model import unit_label

if TYPE_CHECKING:
    from gpuguard.web.sources import ServerStatus

CONNECT_TIMEOUT_S = 2
STATEMENT_TIMEOUT_MS = 5000

NODES = """SELECT n.name AS node, n.last_seen, n.lease, extract(epoch FROM clock_timestamp())::double precision AS now,
       g.minor, g.uuid, g.name AS gpu_name, g.memory_total, g.owner
FROM gpuguard.nodes n LEFT JOIN gpuguard.gpus g ON g.node = n.name ORDER BY n.name, g.minor"""
GRANTS = """SELECT node, minor, username, uid, granted_at, expires_at, shared, origin FROM gpuguard.grants
WHERE %(user)s::text IS NULL OR username = %(user)s ORDER BY node, minor, username"""
QUEUE = """SELECT node, ticket, username, gpus, since, priority FROM gpuguard.queue
ORDER BY node, priority DESC, since, ticket"""
LEDGER = """SELECT node, username, minor, started, ended FROM gpuguard.ledger
WHERE started < %(until)s AND ended > %(since)s AND (%(user)s::text IS NULL OR username = %(user)s)"""


class FleetSource:
    """A `Source` over the fleet's PostgreSQL (conninfo: [fleet] database). Where `gpuguard fleet
    init` wrote the web's passfile (fleet-web.pgpass in `credentials`, readable by the web's
    account only), the web logs in as gpuguard_web, which may read what the web shows and write
    nothing; otherwise as `conninfo` says (a fleet set up before roles: root's passfile, which the
    web's account cannot read, is no use to it)."""

    def __init__(self, conninfo: str, credentials: Path | None = None):
        from gpuguard.fleet import roles  # psycopg's: loaded only where [fleet] is configured
        self.conninfo = roles.derived(conninfo, roles.WEB, credentials or roles.CREDENTIALS) or conninfo

    def _query(self, *statements: tuple[str, Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
        import psycopg  # the fleet's dependency: loaded only where [fleet] is configured
        from psycopg.rows import dict_row

        from gpuguard.fleet.fleetdb import SESSION_OPTIONS

        with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                             application_name="gpuguard web",
                             options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c default_transaction_read_only=on "
                                     f"{SESSION_OPTIONS}",
                             row_factory=dict_row) as conn:
            return [conn.execute(sql, params).fetchall() for sql, params in statements]

    async def _ask(self, *statements: tuple[str, Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
        from gpuguard.client import DaemonUnreachable
        try:
            return await asyncio.to_thread(self._query, *statements)
        except Exception as exc:  # psycopg.Error, and libpq's own errors: one line for the page
            raise DaemonUnreachable(f"fleet database: {str(exc).strip().splitlines()[0] if str(exc) else exc!r}") from None

    async def servers(self) -> list[ServerStatus]:
        from gpuguard.web.sources import ServerStatus
        try:
            nodes, grants, queue = await self._ask((NODES, {}), (GRANTS, {"user": None}), (QUEUE, {}))
        except Exception as exc:
            return [ServerStatus("fleet", None, str(exc))]
        return [ServerStatus(name, status, error) for name, status, error in fleet_status(nodes, grants, queue)]

    async def whoami(self, user: str) -> dict[str, dict[str, Any]]:
        nodes, grants, queue = await self._ask((NODES, {}), (GRANTS, {"user": user}), (QUEUE, {}))
        return fleet_whoami(user, nodes, grants, queue)

    async def report(self, by: str, since: float, until: float, user: str | None) -> dict[str, dict[str, Any]]:
        params = {"since": since, "until": until, "user": user}
        ledger, grants = await self._ask((LEDGER, params), (GRANTS, params))
        entries = [(r["node"], r["username"], r["minor"], r["started"], r["ended"]) for r in ledger]
        now = min(until, datetime.datetime.now().timestamp())
        entries += [(g["node"], g["username"], g["minor"], g["granted_at"], now) for g in grants]
        return ledger_report(by, entries, since, until)

    async def fairshare(self) -> dict[str, dict[str, Any]]:
        """None known: each node decays its own usage with its own half-life and shares, which the
        database does not hold (the Me page says the standing is not available)."""
        return {}

    async def use_history(self, span: str) -> dict[str, dict[str, Any]]:
        """None known: utilisation and memory stay on each node (the History page says so)."""
        return {}


# --- pure: rows in, the daemon's reply shapes out (views.py reads both sources alike)

def fleet_status(nodes: Iterable[Mapping[str, Any]], grants: Iterable[Mapping[str, Any]],
                 queue: Iterable[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any], str | None]]:
    """Per node: a status reply (GPUs with holders, the queue) and, for a lost node, why it is stale."""
    held: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for g in grants:
        held.setdefault((g["node"], g["minor"]), []).append(
            {"user": g["username"], "uid": g["uid"], "granted_at": g["granted_at"], "expires_at": g["expires_at"],
             "last_active": None, "shared": g["shared"], "origin": g["origin"], "gpu_memory": None,
             "memory_used": None})
    waiting: dict[str, list[dict[str, Any]]] = {}
    for q in queue:
        entries = waiting.setdefault(q["node"], [])
        entries.append({"position": len(entries) + 1, "user": q["username"], "gpus": q["gpus"], "since": q["since"],
                        "priority": q["priority"]})
    servers: dict[str, tuple[dict[str, Any], str | None]] = {}
    for row in nodes:
        name = row["node"]
        if name not in servers:
            lost = row["now"] - row["last_seen"] > row["lease"]
            servers[name] = ({"gpus": [], "queue": waiting.get(name, [])},
                             f"lost: last heard from at {clock(row['last_seen'])}; showing what it sent then" if lost
                             else None)
        if row["minor"] is not None:
            servers[name][0]["gpus"].append({
                "minor": row["minor"], "label": unit_label(row["minor"]), "profile": None, "uuid": row["uuid"],
                "name": row["gpu_name"], "memory_total": row["memory_total"], "memory_used": None,
                "utilization": None, "process_list": None, "owner": row["owner"],
                "holders": held.get((name, row["minor"]), [])})
    return [(name, status, error) for name, (status, error) in servers.items()]


def fleet_whoami(user: str, nodes: Iterable[Mapping[str, Any]], grants: Iterable[Mapping[str, Any]],
                 queue: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per node where the user holds a GPU or waits: their grants and queue place."""
    gpus = {(n["node"], n["minor"]): n for n in nodes if n["minor"] is not None}
    replies: dict[str, dict[str, Any]] = {}

    def reply(node: str) -> dict[str, Any]:
        return replies.setdefault(node, {"user": user, "grants": [], "queue": None, "sessions": [], "events": []})

    for g in grants:
        if g["username"] == user:
            gpu = gpus.get((g["node"], g["minor"]), {})
            reply(g["node"])["grants"].append({"minor": g["minor"], "uuid": gpu.get("uuid"), "name": gpu.get("gpu_name"),
                                               "granted_at": g["granted_at"], "expires_at": g["expires_at"],
                                               "origin": g["origin"]})
    by_node: dict[str, list[Mapping[str, Any]]] = {}
    for q in queue:
        by_node.setdefault(q["node"], []).append(q)
    for node, entries in by_node.items():
        for place, q in enumerate(entries, start=1):
            if q["username"] == user:
                ahead = [{"user": a["username"], "why": "higher priority" if a["priority"] > q["priority"]
                          else "asked first"} for a in reversed(entries[:place - 1])]
                reply(node)["queue"] = {"position": place, "waiting": len(entries), "gpus": q["gpus"],
                                        "since": q["since"], "ahead": ahead, "estimate": None}
    return replies


def ledger_report(by: str, entries: Iterable[tuple[str, str, int, float, float]], since: float,
                  until: float) -> dict[str, dict[str, Any]]:
    """Per node, a report as the daemon makes it: granted seconds per user, GPU or local day within
    [since, until); busy and idle unknown (None)."""
    sums: dict[str, dict[Any, float]] = {}
    for node, user, unit, started, ended in entries:
        start, end = max(started, since), min(ended, until)
        if end <= start:
            continue
        per_key = sums.setdefault(node, {})
        for key, seconds in _pieces(by, user, unit, start, end):
            per_key[key] = per_key.get(key, 0.0) + seconds
    return {node: {"rows": [_row(key, seconds) for key, seconds in sorted(per_key.items())],
                   "total": _row("total", sum(per_key.values()))} for node, per_key in sums.items()}


def _pieces(by: str, user: str, unit: int, start: float, end: float) -> list[tuple[Any, float]]:
    if by == "user":
        return [(user, end - start)]
    if by == "gpu":
        return [(unit, end - start)]
    pieces = []
    while start < end:  # split at local midnights
        day = datetime.date.fromtimestamp(start)
        midnight = datetime.datetime.combine(day + datetime.timedelta(days=1), datetime.time()).timestamp()
        pieces.append((day.isoformat(), min(end, midnight) - start))
        start = midnight
    return pieces


def _row(key: Any, granted: float) -> dict[str, Any]:
    return {"key": key, "granted_seconds": granted, "busy_seconds": None, "idle_seconds": None, "kills": {}}
