"""The socket operations of a fleet: `fleet_status` (every server) and `where` (which server for me).

Both read fleetdb.VIEW through a small connection pool on a worker thread, never on the event
loop. What any user can make this cost is bounded: one query a second for everybody together
(a result younger than CACHE_FOR is shared), at most POOL_SIZE connections, READ_WAIT seconds per
look. When the database cannot be read the last view is answered, with the time it is stale since.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import psycopg
import psycopg_pool

from gpuguard import protocol
from gpuguard.config import Config
from gpuguard.core import policy
from gpuguard.core.errors import UnknownUser
from gpuguard.fleet import lineage_memory, ranking
from gpuguard.fleet.fleetdb import check_fence, connection_options, view
from gpuguard.fleet.node import FleetNode
from gpuguard.services.edges import Lookup

if TYPE_CHECKING:
    from gpuguard.daemon.server import Peer  # the daemon calls these operations

CACHE_FOR = 1.0  # seconds a view is shared between callers
POOL_SIZE = 2
READ_TIMEOUT = 3.0  # seconds a caller waits for a pooled connection
# Seconds a caller waits for the view's read, connection included. A link that swallows packets
# behind something that still acknowledges them (a stuck proxy) never errors on a pooled
# connection: statement_timeout is the server's, which never sees the query. Past this the last
# view is answered, stale; the stuck read keeps its pooled connection (POOL_SIZE at most).
READ_WAIT = 5.0
IDLE_FOR = 60.0     # seconds a pooled connection is kept unused
MAX_WANTED = 1024


class FleetOps:
    def __init__(self, config: Callable[[], Config], node: FleetNode, lookup: Lookup):
        self.config = config
        self.node = node
        self.lookup = lookup
        settings = node.config
        # No connection kept while nobody looks (a fleet of thousands of nodes holds one each, the
        # worker's, not three); one opened for a look stays IDLE_FOR seconds for the next.
        # The view is read only from a database the node may write to (fencing.py): a stale old
        # leader's view would look live.
        memory = lineage_memory(config())
        self.pool = psycopg_pool.ConnectionPool(settings.database, min_size=0, max_size=POOL_SIZE, open=False,
                                                timeout=READ_TIMEOUT, max_idle=IDLE_FOR,
                                                kwargs={"autocommit": True, **connection_options(settings.node)},
                                                configure=lambda conn: check_fence(conn, memory))
        self.pool.open(wait=False)
        self._rows: list[dict[str, Any]] = []
        self._read_at: float | None = None   # when the cached rows were read
        self._failed_at: float | None = None  # the view could not be read since then (None: the last read worked)
        self._lock = asyncio.Lock()

    async def _fleet(self) -> list[ranking.NodeView]:
        async with self._lock:  # one read at a time; the others share its result
            fresh = self._read_at is not None and time.monotonic() - self._read_at < CACHE_FOR
            if not fresh and (self._failed_at is None or time.monotonic() - self._failed_at >= CACHE_FOR):
                try:
                    self._rows = await asyncio.wait_for(asyncio.to_thread(self._read), READ_WAIT)
                    self._read_at, self._failed_at = time.monotonic(), None
                except (psycopg.Error, psycopg_pool.PoolTimeout, asyncio.TimeoutError):
                    self._failed_at = time.monotonic()
        return ranking.nodes(self._rows)

    def _read(self) -> list[dict[str, Any]]:
        with self.pool.connection() as conn:
            return view(conn)

    def _freshness(self) -> dict[str, Any]:
        node = self.node
        return {"node": node.config.node, "online": node.online, "stale_since": node.stale_since,
                "offline_reason": None if node.online else node.offline_reason,
                "identity": str(node.identity), "name_clash": node.name_clash,
                "view_stale": self._failed_at is not None, "now": time.time()}

    async def handle(self, request: dict[str, Any], peer: Peer) -> dict[str, Any]:
        if request["op"] == "fleet_status":
            fleet = await self._fleet()
            return protocol.ok(nodes=[{**asdict(node), "free": node.free} for node in fleet], **self._freshness())
        return await self.where(request, peer)

    async def where(self, request: dict[str, Any], peer: Peer) -> dict[str, Any]:
        wanted, data = request.get("gpus", 1), request.get("data")
        if isinstance(wanted, bool) or not isinstance(wanted, int) or not 1 <= wanted <= MAX_WANTED:
            return protocol.refused(f"field 'gpus': a whole number from 1 to {MAX_WANTED}, got {protocol.shown(wanted)}", 2)
        if data is not None and (not isinstance(data, str) or not data.startswith("/") or len(data) > 4096):
            return protocol.refused(f"field 'data': an absolute path, got {protocol.shown(data)}", 2)
        try:
            account = await self.lookup.by_uid(peer.uid)
        except UnknownUser as exc:
            return protocol.refused(str(exc))
        config = self.config()
        quota = policy.quota_for(account.name, account.groups, config)
        holders = ranking.data_holders(data, self.node.config.data) if data else None
        if data and holders is None:
            return protocol.refused(f"{data} is not under any path of [fleet.data] "
                                    f"({', '.join(p for p, _ in self.node.config.data) or 'none configured'})", 2)
        fleet = await self._fleet()
        choices = ranking.rank(fleet, account.name, quota.fleet_gpus, wanted, holders, per_node=quota.gpus)
        return protocol.ok(user=account.name, fleet_gpus=quota.fleet_gpus, held=ranking.held_by(fleet, account.name),
                           wanted=wanted, data=data, data_holders=list(holders or ()),
                           choices=[{"node": c.node.name, "rack": c.node.rack, "ssh": c.ssh, "free": c.node.free,
                                     "may_take": c.may_take, "queued": c.node.queued,
                                     "locality": None if c.locality is None else ranking.LOCALITY[c.locality]}
                                    for c in choices], **self._freshness())

    def close(self) -> None:
        self.pool.close(timeout=1.0)

