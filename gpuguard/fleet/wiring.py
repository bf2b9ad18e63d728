"""Building a node's fleet services (gpuguard.services.wiring.build calls build once, at start)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuguard.config import Config
from gpuguard.core.model import Gpu
from gpuguard.fleet.node import Cluster
from gpuguard.fleet.ops import FleetOps
from gpuguard.fleet.outbox import Outbox
from gpuguard.services.edges import FleetDatabase, Lookup
from gpuguard.services.store import Store


@dataclass(frozen=True)
class Fleet:
    cluster: Cluster
    ops: FleetOps

    def close(self) -> None:
        self.ops.close()
        self.cluster.close()


def build(db: FleetDatabase, config: Callable[[], Config], store: Store, units: Callable[[], Mapping[int, Gpu]],
          foreign: Sequence[dict[str, Any]], lookup: Lookup) -> Fleet:
    """A node's fleet services ([cluster] is read at start only). Nothing here waits on the
    database: the node starts offline and the first heartbeat brings it online.
    units: what this node hands out now (Grants.gpus); foreign: the status entries of the GPUs
    Slurm or Kubernetes own here (coexist.status_entries), mirrored with their owner."""
    start = config()
    settings = start.cluster
    if settings is None:
        raise ValueError("a fleet database without [cluster] in the config")
    outbox = Outbox(start.paths.state_dir / "cluster.db")
    cluster = Cluster(settings, lambda: config().scheduler.half_life, store, units, foreign, outbox, db)
    return Fleet(cluster, FleetOps(config, cluster, lookup))
