"""The service graph, built once (build), from typed edges (Edges, whose kinds edges.py names).

The daemon, the unit tests (tests/unit/fakes.py) and a replay all call build: each service is
made here and handed exactly the others it uses, so the three cannot wire them differently. The
callers differ only in the edges they pass: the kernel and the hardware (daemon/main.py), fakes that
record what was asked (the unit tests), or a virtual clock and a simulated sample (a replay).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import Collector

from gpuguard import fleet
from gpuguard.config import Config
from gpuguard.core.allocator import Topology
from gpuguard.core.model import Gpu, Rule
from gpuguard.daemon.admission import Budget
from gpuguard.daemon.api import HOLDS_FILE, Api, nowhere_else
from gpuguard.daemon.metrics import Metrics
from gpuguard.services import drains, state_files
from gpuguard.services.edges import (
    Clock,
    ExitWatch,
    FleetDatabase,
    GateMap,
    GpuSampler,
    Lookup,
    Nodes,
    OpenerSearch,
    Processes,
    Terminals,
    VisibleDevices,
)
from gpuguard.services.exempt import Exempt
from gpuguard.services.grants import Grants
from gpuguard.services.logout import LogoutRelease
from gpuguard.services.lookups import KnownAccounts, membership
from gpuguard.services.openers import OpenerEnder
from gpuguard.services.queueing import Queue
from gpuguard.services.release import Releases
from gpuguard.services.reload_effects import ReloadEffects
from gpuguard.services.scans import Scans
from gpuguard.services.store import Store
from gpuguard.services.usage import UsageMeter
from gpuguard.services.watcher import ACTIVE_WRITE_EVERY, Watcher

if TYPE_CHECKING:
    from gpuguard.fleet.wiring import FleetServices


@dataclass(frozen=True)
class Edges:
    """What the services are built from. Only these differ between the daemon, the unit tests
    and a replay."""

    config: Callable[[], Config]     # the config in force: a reload replaces what this returns
    store_path: Path                 # the SQLite state (made when missing)
    sampler: GpuSampler              # samples of the GPUs (NVML, the simulated GPUs, a replay's jobs)
    units: Mapping[int, Gpu]         # the GPUs and MIG slices read at start, by unit
    driver_minors: Collection[int]   # the GPUs the driver has, also those NVML cannot read
    nodes: Nodes                     # the device nodes and their ACLs
    lookup: Lookup                   # NSS
    terminals: Terminals             # telling users
    exits: ExitWatch                 # being told when processes exit
    # /proc: who holds a node open; None: nothing beyond the sampled processes does (a replay)
    find_openers: OpenerSearch | None
    processes: Processes             # who a process is; signals
    gate: GateMap | None = None      # None in access.mode = acl
    topology: Topology | None = None
    caps_major: int | None = None    # of the MIG capability nodes (None: no MIG capabilities)
    clock: Clock = time.time
    durable: bool = True             # False: a scratch store (a replay): no fsync, no idle clocks kept in it
    reload: Callable[[], Config] | None = None  # the `reload` operation (None: the config stays)
    sync_nodes: Callable[[], None] = field(default=lambda: None)  # the `sync_nodes` operation
    # `status` entries of the GPUs Slurm or Kubernetes own (coexist.status_entries): shown, never handed out
    foreign: Sequence[dict[str, Any]] = ()
    # A fleet's PostgreSQL ([fleet]: fleet.database makes it); None on a single server
    fleet_db: FleetDatabase | None = None
    # each holder's CUDA_VISIBLE_DEVICES for the PAM module when no daemon answers (None: not kept)
    visible_devices: VisibleDevices | None = None
    # webhook and e-mail notices by (channel, outcome): sent, failed, dropped (remote_notify)
    notices: Callable[[], Mapping[tuple[str, str], int]] = dict
    # the connection budget the metrics endpoint shares with the socket (server.Server's); None: one of its own
    connections: Budget | None = None
    # the edges' own metrics (the process index's), served beside the services'
    collectors: Sequence[Collector] = ()


@dataclass(frozen=True)
class Services:
    """Every service, wired. Close with close()."""

    store: Store
    grants: Grants
    exempt: Exempt
    accounts: KnownAccounts
    usage: UsageMeter
    scans: Scans
    openers: OpenerEnder
    queue: Queue
    releases: Releases
    logout: LogoutRelease
    reload_effects: ReloadEffects
    watcher: Watcher
    api: Api
    metrics: Metrics
    fleet: FleetServices | None  # several servers, one PostgreSQL (gpuguard.fleet); None on a single server
    edges: Edges

    def close(self) -> None:
        """Stop what runs in the background and write what is kept in memory; the edges that hold
        threads (NSS, terminals, the fleet's database) are closed too. The store is closed last."""
        if self.fleet is not None:
            self.fleet.close()
        self.metrics.close()
        self.logout.close()
        self.openers.close()
        self.scans.close()
        self.usage.flush()
        self.edges.terminals.close()
        self.edges.lookup.close()
        self.store.close()


def _ends_nothing(uid: int, user: str, units: Iterable[int], why: Rule) -> None:
    pass


def build(edges: Edges) -> Services:
    """The one wiring of the services (see the README's architecture section)."""
    config = edges.config
    state_dir = edges.store_path.parent  # the admin's drains and queue holds are kept beside the store
    store = Store(edges.store_path, lambda: config().events, durable=edges.durable)
    # The fleet mirrors what Grants hands out now (its units change with the MIG layout): read
    # through a function, as the fleet's check is handed to Grants when it is made.
    fleet_services = None if edges.fleet_db is None else fleet.build(
        edges.fleet_db, config, store, lambda: grants.gpus, edges.foreign, edges.lookup)
    grants = Grants(store, edges.gate, edges.nodes, edges.driver_minors, gpus=edges.units,
                    topology=edges.topology, caps_major=edges.caps_major, visible_devices=edges.visible_devices,
                    admit=fleet_services.node.admit if fleet_services else None)
    grants.drained.update(drains.load(state_dir / drains.FILE))

    def apply_exempt(uids: frozenset[int]) -> None:
        if edges.gate is not None:
            edges.gate.set_exempt(uids)
        grants.set_exempt(uids)  # exempt users need ACL entries too: the nodes are 0660 root:root

    exempt = Exempt(lambda: config().access, store, apply_exempt, edges.lookup)
    accounts = KnownAccounts(edges.lookup, config)
    usage = UsageMeter(store, accounts.name_of)
    # the /proc scans users' requests cause and the daemon's own, in pools of their own (scans.py)
    scans = Scans(edges.find_openers, grants.opener_devices)
    openers = OpenerEnder(scans, edges.sampler, exempt, store, lambda: config().watcher.kill_wait,
                          edges.processes, edges.clock,
                          is_member=lambda uid: membership(edges.lookup, config().access, uid))
    queue = Queue(config, store, grants, remote_usage=fleet_services.node.remote_usage if fleet_services else None)
    queue.holds = state_files.read_ids(state_dir / HOLDS_FILE)

    def tell(uid: int, user: str, message: str) -> None:
        if uid not in exempt.uids:
            edges.terminals.tell(user, uid, message, store.ttys(uid))

    # With no holder search (a replay: the sampled processes are all, and the rules end those),
    # nothing is left to end after a grant is taken back: no background task per release.
    end_openers = openers.schedule if edges.find_openers is not None else _ends_nothing
    releases = Releases(grants, queue, end_openers, tell, fleet_ended=fleet_services.node.ended if fleet_services else None)
    logout = LogoutRelease(store, releases, scans, edges.exits, edges.processes, edges.clock)
    reload_effects = ReloadEffects(store, releases, edges.lookup, tell)
    watcher = Watcher(config, store, releases, exempt, edges.sampler, accounts, edges.terminals, edges.processes,
                      usage, demand=queue.demand,
                      active_write_every=ACTIVE_WRITE_EVERY if edges.durable else None)
    api = Api(config, store, grants, releases, exempt, edges.sampler, edges.lookup, logout, openers, edges.gate,
              apply_reload=edges.reload or config, resync_nodes=edges.sync_nodes, accounts=accounts, usage=usage,
              queue=queue, terminals=edges.terminals, processes=edges.processes, clock=edges.clock,
              reload_effects=reload_effects, state_dir=state_dir, foreign=edges.foreign,
              elsewhere=fleet_services.node.elsewhere if fleet_services else nowhere_else)
    metrics = Metrics(config().metrics, store, grants.gpus, edges.sampler, edges.gate, accounts.of,
                      notices=edges.notices, drained=lambda: grants.drained, budget=edges.connections,
                      collectors=edges.collectors)
    return Services(store, grants, exempt, accounts, usage, scans, openers, queue, releases, logout, reload_effects,
                    watcher, api, metrics, fleet_services, edges)
