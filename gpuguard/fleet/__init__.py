"""Several servers, one lab, one PostgreSQL: fleet-wide quotas, fair share and views.

Each server keeps its SQLite store and its gate as the enforcement truth; the database holds a
mirror of every node (its GPUs, grants and queue, sent by a heartbeat), the usage ledger and the
fleet quota rows that grant-time checks lock. A database outage never opens or closes a gate.

- schema.py: the PostgreSQL schema as ordered, additive migrations (rolling upgrades);
- fleetdb.py: the SQL edge (psycopg): heartbeat, reserve, the views; every call one round trip;
- outbox.py: the SQLite outbox of ended grants (the usage ledger) kept until the database has them;
- node.py: the node's side in the daemon: the ordered worker, bounded waits, offline policy, caches;
- roles.py: one database role per node, the admin's and the web's (`gpuguard fleet init`);
- ranking.py: pure: which server `gpuguard where` recommends, data locality included;
- ops.py: the socket operations `fleet_status` and `where`; wiring.py builds them (called by
  gpuguard.services.wiring.build, from the database edge that `database` makes).

This module imports nothing heavy: a single server never loads psycopg.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpuguard import protocol

if TYPE_CHECKING:
    from gpuguard.config import Config
    from gpuguard.core.model import Gpu
    from gpuguard.fleet.fencing import LineageMemory
    from gpuguard.fleet.wiring import FleetServices
    from gpuguard.services.edges import FleetDatabase, Lookup
    from gpuguard.services.store import Store

OPERATIONS = frozenset({"fleet_status", "where"})  # the socket operations of gpuguard.fleet.ops
LINEAGE_FILE = "fleet-lineage.json"  # in the state directory: the database this node writes to (fencing.py)


def database(config: Config) -> FleetDatabase | None:
    """The fleet database's edge for the daemon (psycopg, imported here only), or None for a
    single server (no [fleet]). Nothing connects before the first heartbeat."""
    if config.fleet is None:
        return None
    try:
        from gpuguard.fleet.fleetdb import FleetDb
    except ImportError as exc:  # the package only suggests psycopg: a single server needs none
        from gpuguard.fleet.schema import FleetError
        raise FleetError(f"[fleet] is set, but {exc.name or 'psycopg'} cannot be loaded: install python3-psycopg and "
                         "python3-psycopg-pool (pip: psycopg psycopg-pool), or remove [fleet]") from None
    return FleetDb(config.fleet.database, config.fleet.node, lineage_memory(config))


def lineage_memory(config: Config) -> LineageMemory:
    """The node's memory of the database it writes to (fencing.py), kept in its state directory."""
    from gpuguard.fleet.fencing import LineageMemory
    assert config.fleet is not None  # only a fleet's node has one
    return LineageMemory(config.paths.state_dir / LINEAGE_FILE, config.fleet.database)


def build(db: FleetDatabase, config: Callable[[], Config], store: Store, units: Callable[[], Mapping[int, Gpu]],
          foreign: Sequence[dict[str, Any]], lookup: Lookup) -> FleetServices:
    """The fleet services, for gpuguard.services.wiring.build (which calls this only with a fleet database)."""
    from gpuguard.fleet import wiring
    return wiring.build(db, config, store, units, foreign, lookup)


async def not_in_fleet(request: dict[str, Any], peer: Any) -> dict[str, Any]:
    return protocol.refused("this server is not part of a fleet (no [fleet] in its gpuguard.toml)")
