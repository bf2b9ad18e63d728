"""Building a node's fleet services (gpuguard.services.wiring.build calls build once, at start)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuguard.config import Config
from gpuguard.core.model import Gpu
from gpuguard.fleet import identity
from gpuguard.fleet.node import FleetNode
from gpuguard.fleet.ops import FleetOps
from gpuguard.fleet.outbox import Outbox
from gpuguard.services.edges import FleetDatabase, Lookup
from gpuguard.services.store import Store


@dataclass(frozen=True)
class FleetServices:
    node: FleetNode
    ops: FleetOps

    def close(self) -> None:
        self.ops.close()
        self.node.close()


def build(db: FleetDatabase, config: Callable[[], Config], store: Store, units: Callable[[], Mapping[int, Gpu]],
          foreign: Sequence[dict[str, Any]], lookup: Lookup) -> FleetServices:
    """A node's fleet services ([fleet] is read at start only). Nothing here waits on the
    database: the node starts offline and the first heartbeat brings it online.
    units: what this node hands out now (Grants.gpus); foreign: the status entries of the GPUs
    Slurm or Kubernetes own here (coexist.status_entries), mirrored with their owner."""
    start = config()
    settings = start.fleet
    if settings is None:
        raise ValueError("a fleet database without [fleet] in the config")
    outbox = Outbox(_outbox_path(start.paths.state_dir))
    node = FleetNode(settings, lambda: config().scheduler.half_life, store, units, foreign, outbox, db,
                     identity.load(start.paths.state_dir))
    return FleetServices(node, FleetOps(config, node, lookup))


def _outbox_path(state_dir: Path) -> Path:
    """The outbox's file: fleet.db; one a release before this kept as cluster.db (the feature's old
    name) is renamed to it first, with its WAL, so that no ended grant it holds is lost."""
    path = state_dir / "fleet.db"
    old = state_dir / "cluster.db"
    if old.exists() and not path.exists():
        for suffix in ("-wal", "-shm", ""):  # the database file last: its presence says it is done
            if (old_part := old.with_name(old.name + suffix)).exists():
                old_part.rename(path.with_name(path.name + suffix))
    return path
