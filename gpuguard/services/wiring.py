"""The service graph, built once (build), from typed edges (Edges, whose kinds edges.py names).

The daemon, the unit tests (tests/unit/fakes.py) and a replay all call build: each service is
made here and handed exactly the others it uses, so the three cannot wire them differently. The
callers differ only in the edges they pass: the kernel and the hardware (daemon/main.py), fakes that
record what was asked (the unit tests), or a virtual clock and a simulated sample (a replay). The
daemon's own front (the operations and the metrics) is built on top, by daemon.wiring.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard import fleet
from gpuguard.config import Config
from gpuguard.core.allocator import Topology
from gpuguard.core.model import Gpu, Rule
from gpuguard.services.asks import Asks
from gpuguard.services.drains import FILE as DRAINS_FILE
from gpuguard.services.drains import Drains
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
from gpuguard.services.holds import FILE as HOLDS_FILE
from gpuguard.services.holds import QueueHolds
from gpuguard.services.logins import Logins
from gpuguard.services.logout import LogoutRelease
from gpuguard.services.lookups import KnownAccounts, membership
from gpuguard.services.openers import OpenerEnder
from gpuguard.services.queueing import Queue
from gpuguard.services.release import Releases
from gpuguard.services.reload_effects import ReloadEffects
from gpuguard.services.scans import Scans
from gpuguard.services.store import Store
from gpuguard.services.tickets import Tickets
from gpuguard.services.usage import UsageMeter
from gpuguard.services.use_history import UseHistory
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
    # A replay's virtual clock and sample: a scratch store (no fsync, no idle clocks kept in it),
    # drains and holds in memory only, and no gaps in what the watcher observes (the sample changes
    # only with the replay's events, which it tells the watcher of)
    virtual: bool = False
    # `status` entries of the GPUs Slurm or Kubernetes own (coexist.status_entries): shown, never handed out
    foreign: Sequence[dict[str, Any]] = ()
    # A fleet's PostgreSQL ([fleet]: fleet.database makes it); None on a single server
    fleet_db: FleetDatabase | None = None
    # each holder's CUDA_VISIBLE_DEVICES for the PAM module when no daemon answers (None: not kept)
    visible_devices: VisibleDevices | None = None


@dataclass(frozen=True)
class Services:
    """Every service, wired. Close with close()."""

    store: Store
    drains: Drains
    grants: Grants
    exempt: Exempt
    accounts: KnownAccounts
    usage: UsageMeter
    scans: Scans
    openers: OpenerEnder
    holds: QueueHolds
    queue: Queue
    asks: Asks
    tickets: Tickets
    releases: Releases
    logout: LogoutRelease
    reload_effects: ReloadEffects
    logins: Logins
    watcher: Watcher
    use_history: UseHistory  # utilisation and memory over time, from the ticks' samples
    fleet: FleetServices | None  # several servers, one PostgreSQL (gpuguard.fleet); None on a single server
    edges: Edges

    async def reload(self, old: Config, new: Config, now: float) -> None:
        """What a reload of the config does to the services, all at once: the exempt users asked
        again (NSS, bounded in time), the MIG layout read again (through the sampler: NVML is used
        from one thread at a time), and what the new config does to grants already given (former
        members' taken back, lowered idle limits warned first). The caller has put `new` in force."""
        async def layout() -> None:
            sample = await self.edges.sampler.take_or_log("MIG layout read at the next tick", max_age=0)
            if sample is not None:
                self.releases.follow_layout(sample.layout, self.edges.clock())

        await asyncio.gather(self.exempt.refresh(), layout(), self.reload_effects.apply(old, new, now))

    def close(self) -> None:
        """Stop what runs in the background and write what is kept in memory; the edges that hold
        threads (NSS, terminals, the fleet's database) are closed too. The store is closed last."""
        if self.fleet is not None:
            self.fleet.close()
        self.logout.close()
        self.openers.close()
        self.scans.close()
        self.usage.flush()
        self.use_history.close()
        self.edges.terminals.close()
        self.edges.lookup.close()
        self.store.close()


def _ends_nothing(uid: int, user: str, units: Iterable[int], why: Rule) -> None:
    pass


def build(edges: Edges) -> Services:
    """The one wiring of the services (see the architecture doc)."""
    config = edges.config
    # The admin's drains and queue holds are kept beside the store (a replay's: in memory only).
    state_dir = None if edges.virtual else edges.store_path.parent
    store = Store(edges.store_path, lambda: config().events, durable=not edges.virtual)
    # The fleet mirrors what Grants hands out now (its units change with the MIG layout): read
    # through a function, as the fleet's check is handed to Grants when it is made.
    fleet_services = None if edges.fleet_db is None else fleet.build(
        edges.fleet_db, config, store, lambda: grants.gpus, edges.foreign, edges.lookup)
    node = fleet_services.node if fleet_services else None
    drains = Drains(state_dir / DRAINS_FILE if state_dir else None)
    grants = Grants(store, edges.gate, edges.nodes, edges.driver_minors, gpus=edges.units,
                    topology=edges.topology, caps_major=edges.caps_major, visible_devices=edges.visible_devices,
                    admit=node.admit if node else None, drains=drains,
                    last_seen=lambda uid, unit: watcher.last_seen(uid, unit),  # the watcher comes later
                    placement=lambda: config().scheduler.fraction_placement)

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
                          is_member=lambda uid: membership(edges.lookup, config().access, uid),
                          reaches=grants.reaches, accounts=accounts)
    holds = QueueHolds(state_dir / HOLDS_FILE if state_dir else None, store)
    queue = Queue(config, store, grants, holds, remote_usage=node.remote_usage if node else None,
                  held_elsewhere=node.held_elsewhere if node else None)
    asks = Asks(config, store, grants, queue)
    tickets = Tickets(store, queue, grants, edges.terminals, edges.clock)
    queue.listeners.append(tickets.served)
    queue.departures.append(tickets.departed)

    def tell(uid: int, user: str, message: str) -> None:
        if uid not in exempt.uids:
            edges.terminals.tell(user, uid, message, store.ttys(uid))

    # With no opener search (a replay: the sampled processes are all, and the rules end those),
    # nothing is left to end after a grant is taken back: no background task per release.
    end_openers = openers.schedule if edges.find_openers is not None else _ends_nothing
    releases = Releases(grants, queue, end_openers, tell, fleet_ended=node.ended if node else None)
    logout = LogoutRelease(store, releases, scans, edges.exits, edges.processes, edges.sampler, edges.clock)
    reload_effects = ReloadEffects(store, releases, tickets, edges.lookup, tell)
    logins = Logins(config, store, asks, queue, exempt, reload_effects, logout, edges.processes, edges.clock)
    watcher = Watcher(config, store, releases, exempt, edges.sampler, accounts, edges.terminals, edges.processes,
                      usage, demand=queue.demand,
                      active_write_every=None if edges.virtual else ACTIVE_WRITE_EVERY, gaps=not edges.virtual)
    return Services(store, drains, grants, exempt, accounts, usage, scans, openers, holds, queue, asks, tickets,
                    releases, logout, reload_effects, logins, watcher, UseHistory(store), fleet_services, edges)
