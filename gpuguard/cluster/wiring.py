"""Building a node's fleet services from the config (the daemon calls build once at start)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuguard.cluster.fleetdb import FleetDb
from gpuguard.cluster.ops import FleetOps
from gpuguard.cluster.outbox import Outbox
from gpuguard.cluster.service import Cluster
from gpuguard.config import ClusterConfig, Config
from gpuguard.grants import Grants
from gpuguard.lookups import AccountLookup
from gpuguard.store import Store


@dataclass(frozen=True)
class Fleet:
    cluster: Cluster
    ops: FleetOps

    def close(self) -> None:
        self.ops.close()
        self.cluster.close()


def build(config: Config, settings: ClusterConfig, current: Callable[[], Config], store: Store, grants: Grants,
          lookup: AccountLookup) -> Fleet:
    """A node's fleet services. Nothing here waits on the database: the node starts offline
    and the first heartbeat brings it online."""
    outbox = Outbox(config.paths.state_dir / "cluster.db")
    cluster = Cluster(settings, lambda: current().scheduler.half_life, store, grants, outbox,
                      FleetDb(settings.database, settings.node))
    return Fleet(cluster, FleetOps(current, cluster, lookup))
