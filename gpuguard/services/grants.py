"""Giving and taking GPUs, choosing them included: the store records a grant, the gate and the
device ACLs follow from the store, and the allocator (pure) picks which GPUs a user gets.

A grant is on a unit (model.py): a whole GPU, or a MIG slice. Its holder may open the unit's
device nodes (devices_of): the GPU's /dev/nvidia<N>; for a slice its parent's node and the
slice's GI and CI access capability nodes (/dev/nvidia-caps/nvidia-cap<N>), which the driver
checks before it lets a process use the slice. Gate entries and node ACLs are the union over a
user's grants, so two slices of one GPU share the parent's entry and ACL line.

Order is chosen so that what the kernel enforces never exceeds what the store says: a grant
is written to the store before the gate opens, a release closes the gate before the store
forgets. A crash in between therefore leaves, at worst, a grant the gate does not honour
yet, which reconcile() at the next start repairs.

Used by the API (logins, requests, admin commands) and release.Releases, the one step that takes
grants back (store, gate, ACLs here; then the holders, the fair share and the queue); all calls
come from the event-loop thread, as the store requires.
"""
from __future__ import annotations

import logging
import re
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpuguard.core import allocator, layout, policy
from gpuguard.core.allocator import Topology
from gpuguard.core.messages import unit_list
from gpuguard.core.model import (
    NVIDIA_MAJOR,
    Device,
    Event,
    EventKind,
    Gpu,
    Grant,
    Origin,
    Placement,
    Quota,
    Rule,
    is_slice,
    unit_parent,
)
from gpuguard.logs import event
from gpuguard.services.drains import Drains
from gpuguard.services.edges import Entry, GateMap, Nodes, VisibleDevices
from gpuguard.services.store import Store

if TYPE_CHECKING:
    from gpuguard.backends.nvml import MigLayout

_NODE = re.compile(r"nvidia(\d+)")
_CAP_NODE = re.compile(r"nvidia-cap(\d+)")


class Admit(Protocol):
    """A fleet's grant-time check (gpuguard.fleet.node.FleetNode.admit): the part of `chosen` the
    fleet quota allows, recorded in the fleet database."""

    def __call__(self, uid: int, user: str, quota: Quota, chosen: tuple[int, ...], now: float,
                 expires_at: float | None, shared: bool, origin: Origin) -> tuple[int, ...]: ...


ASKS_KEPT = 512  # the asks fractions are placed for: the lab's mix of late, not of all time
ASKS_PER_USER = 32  # of those, one user's at most: a flood of one user's asks moves the mix by 1/16 at most
GIB = 1 << 30

# (uid, unit) -> when a process of that user was last seen on it (the watcher's memory), None: not lately
LastSeen = Callable[[int, int], "float | None"]


class Grants:
    def __init__(self, store: Store, gate: GateMap | None, nodes: Nodes, minors: Collection[int],
                 exempt: Collection[int] = (), gpus: Mapping[int, Gpu] | None = None,
                 topology: Topology | None = None, caps_major: int | None = None, admit: Admit | None = None,
                 visible_devices: VisibleDevices | None = None, drains: Drains | None = None,
                 last_seen: LastSeen | None = None, placement: Callable[[], Placement] = lambda: Placement.FGD):
        """gpus: what NVML reads, GPUs and MIG slices (model.Gpu) by unit; caps_major: the
        nvidia-caps character major (None: no MIG capability nodes on this machine); admit: a
        fleet's grant-time check (gpuguard.fleet), None on a single server; drains: the GPUs given
        to nobody new (None: none, ever); visible_devices: each user's
        CUDA_VISIBLE_DEVICES for logins while the daemon is down (None: not kept); last_seen: when
        the watcher last saw a process of a user on a unit (fresher than the store's last_active);
        placement: how a fraction's GPU is chosen, as the config in force says."""
        self.store = store
        self.visible_devices = visible_devices
        self.gate = gate  # None in access.mode = "acl": the ACLs are the only enforcement
        self.nodes = nodes
        self.caps_major = caps_major
        # The GPUs NVML could read at start and how they are linked: fixed while the driver stays
        # loaded (a GPU that falls off the bus shows as NVML errors in the tick, not as a smaller
        # inventory). Only their MIG mode and slices change (update_layout).
        units = list((gpus or {}).values())
        self.physical: dict[int, Gpu] = {gpu.unit: gpu for gpu in units if gpu.slice is None}
        # The GPUs this machine has, only whose nodes are managed: the driver's (`minors`, also
        # those NVML cannot read) and every one NVML reads.
        self.minors = frozenset(minors) | self.physical.keys()
        self.topology: Topology = dict(topology or {})
        # Each slice's capability minors as last seen: fixed for its (GPU, GI, CI) place while the
        # driver stays loaded, so a grant on a slice that has just vanished is still closed fully.
        self._caps: dict[int, tuple[int, int]] = {}
        self.gpus: dict[int, Gpu] = {}  # what can be handed out now: unit -> GPU or slice
        self._pool: tuple[tuple[int, int], allocator.Pool] | None = None  # pool(), with the pool_version it is of
        self._units_changed = 0  # moves when the units that can be handed out change (a MIG layout)
        self.drained = drains if drains is not None else Drains(None)  # GPUs given to nobody new (their owner's)
        self._set_units(layout.grantable(self.physical.values(), [u for u in units if u.slice is not None]))
        # Exempt users pass the gate, but the nodes are 0660 root:root: they need ACL entries too.
        self.exempt = frozenset(exempt) - {0}
        # The part of the chosen units a fleet quota allows, recorded in the fleet database: it
        # may only make a grant smaller.
        self.admit = admit
        self.last_seen = last_seen
        self.placement = placement
        # (uid, size) of the last ASKS_KEPT asks granted or queued (note_asked), ASKS_PER_USER a user
        # at most: the mix fractions are placed for
        self._asked: deque[tuple[int, int | None]] = deque()

    def write_visible_devices(self, uid: int) -> None:
        """The user's held-devices file as the store now says (after every grant given or taken
        back: add and remove are the only ways a grant changes, so no listener is needed)."""
        if self.visible_devices is not None:
            self.visible_devices.write(uid, [self.gpus[g.unit].uuid for g in sorted(self.store.grants(uid), key=lambda g: g.unit)
                                  if g.unit in self.gpus])

    def write_all_visible_devices(self) -> None:
        """Every holder's file, and none for anyone else (at start: grants changed while no daemon ran)."""
        if self.visible_devices is not None:
            for uid in sorted(self.visible_devices.users() | {g.uid for g in self.store.grants()}):
                self.write_visible_devices(uid)

    def set_exempt(self, uids: Collection[int]) -> None:
        """Change the exempt users; every node's ACL follows at once."""
        uids = frozenset(uids) - {0}
        if uids != self.exempt:
            self.exempt = uids
            self.node_changed(None)

    def _set_units(self, units: Mapping[int, Gpu]) -> None:
        # Changed in place: the metrics and the queue hold this very mapping.
        self.gpus.clear()
        self.gpus.update(units)
        self._units_changed += 1
        self._caps.update({unit: gpu.slice.caps for unit, gpu in units.items() if gpu.slice is not None})

    def devices_of(self, unit: int) -> list[Device]:
        """The nodes a unit's holder may open: a GPU's node; for a slice its parent's node and
        its GI and CI access capability nodes (caps never seen: the parent's only, which by
        itself reaches no slice of a GPU in MIG mode)."""
        parent = (NVIDIA_MAJOR, unit_parent(unit))
        caps = self._caps.get(unit) if is_slice(unit) else None
        if caps is None or self.caps_major is None:
            return [parent]
        return [parent, *((self.caps_major, cap) for cap in caps)]

    def opener_devices(self, unit: int) -> list[Device]:
        """The nodes whose holders use a unit: a GPU's node; a slice's capability nodes (its
        parent's node alone reaches no slice, and the holder's other slices of that GPU need it).
        Reads no store: called from worker threads (backends.sampler.node_openers)."""
        devices = self.devices_of(unit)
        return devices[1:] if is_slice(unit) else devices

    def reaches(self, uid: int, units: Iterable[int]) -> frozenset[int]:
        """Those of `units` whose holders' nodes uid's own grants let it open: the same GPU
        shared, or a slice in the same GPU instance as one of uid's. A process of uid's holding
        one of those may be doing its own work; one holding any other is using a GPU not uid's."""
        mine = {device for grant in self.store.grants(uid) for device in self.devices_of(grant.unit)}
        return frozenset(unit for unit in units if mine.intersection(self.opener_devices(unit)))

    def _entries(self, grants: Iterable[Grant]) -> set[Entry]:
        return {(grant.uid, device) for grant in grants for device in self.devices_of(grant.unit)}

    def choose(self, uid: int, count: int, quota: Quota) -> tuple[int, ...]:
        """Up to `count` more units for uid on the terms of `quota` (allocator.choose over the current grants)."""
        return allocator.choose(self.pool(), self.topology, self.store.grants_read(),
                                self.store.last_released(), uid, count, policy.may_share(quota),
                                self.store.last_held(uid), quota, self.placement(),
                                self.demand_mix() if quota.fraction is not None else None)

    def demand_mix(self) -> Counter[int | None]:
        """The asks fractions are placed for: how many asked each size (bytes; None: whole GPUs)."""
        return Counter(size for _, size in self._asked)

    def note_asked(self, uid: int, memory: int | None) -> None:
        """An ask of uid's granted or queued, of a fraction of `memory` bytes (None: whole GPUs):
        the mix fractions are placed for (allocator.place_fraction). Sizes are kept to the GiB, so
        the mix has few."""
        theirs = [ask for ask in self._asked if ask[0] == uid]
        if len(theirs) >= ASKS_PER_USER:  # their oldest goes instead of someone else's
            self._asked.remove(theirs[0])
        self._asked.append((uid, None if memory is None else -(-memory // GIB) * GIB))
        if len(self._asked) > ASKS_KEPT:
            self._asked.popleft()

    def largest_whole(self) -> int:
        """The memory of the largest whole GPU that may be handed out (0: none)."""
        return max((gpu.memory_total for gpu in self.pool().whole.by_unit.values()), default=0)

    def open_units(self) -> list[Gpu]:
        """The units that may be given to someone new: all but those on a drained GPU."""
        if not self.drained:
            return list(self.gpus.values())
        return [gpu for unit, gpu in self.gpus.items() if unit_parent(unit) not in self.drained]

    def pool(self) -> allocator.Pool:
        """open_units() sorted by kind for the allocator: built again only when the units or the
        drained GPUs changed since, not at every choice."""
        version = self.pool_version
        if self._pool is None or self._pool[0] != version:
            self._pool = (version, allocator.Pool(self.open_units()))
        return self._pool[1]

    @property
    def pool_version(self) -> tuple[int, int]:
        """Moves when pool() does: the units change (a MIG layout), or the drained GPUs."""
        return (self._units_changed, self.drained.version)

    def capacity(self, quota: Quota) -> int:
        """How many units one user could hold at once on the terms of `quota`, were nobody else's
        grants in the way: the open units of a kind it takes. A request for more can never be
        served whole."""
        pool = self.pool()
        slices = sum(allocator.suits(gpu, quota) for gpu in pool.slices)
        if quota.slices is not None:
            slices = min(slices, quota.slices)
        whole = pool.whole.by_unit.values() if quota.whole_gpus else ()
        if quota.fraction is not None:  # a fraction fits only a GPU with at least its memory (a drain may leave none)
            return sum(gpu.memory_total >= quota.fraction for gpu in whole)
        return len(whole) + slices

    def room(self, uid: int, quota: Quota) -> int:
        """How many more units uid could get at once on the terms of `quota`, were nobody else's
        grants in the way, beside all they hold (room_beside)."""
        return self.room_beside(quota, [grant.unit for grant in self.store.grants(uid)])

    def room_beside(self, quota: Quota, kept: Iterable[int]) -> int:
        """How many more units one user could get at once on the terms of `quota` beside the units
        `kept` (theirs), were nobody else's grants in the way: capacity() less the kept units of a
        kind it takes (one kept on a drained GPU is not one of them). More than this can never be
        served whole: the one place that says so."""
        pool, kept = self.pool(), set(kept)
        mine = len(kept.intersection(pool.whole.by_unit)) if quota.whole_gpus else 0
        mine += sum(gpu.unit in kept and allocator.suits(gpu, quota) for gpu in pool.slices)
        return self.capacity(quota) - mine

    def allocate(self, uid: int, user: str, quota: Quota, count: int, now: float, origin: Origin,
                 message: str, chosen: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """Up to `count` more units for the user on the terms of their quota (none when none is free).
        chosen: what choose() just answered for this request, with no grant changed since."""
        chosen = self.choose(uid, count, quota) if chosen is None else chosen
        if chosen and self.cooling(uid, quota, now).keys() & set(map(self.kind_of, chosen)):
            return ()  # all or nothing, as the queue serves its rows: the cool-down ends first
        expires_at, shared = policy.expires_at(quota, now), policy.may_share(quota)
        if chosen and self.admit is not None:
            chosen = self.admit(uid, user, quota, chosen, now, expires_at, shared, origin)
        if not chosen:
            return ()
        self.add(uid, user, chosen, now, expires_at=expires_at, shared=shared, origin=origin, message=message,
                 memory=quota.gpu_memory, last_active=policy.idle_since(
                     quota, now, map(self._used_at, self.store.grants(uid)), self.store.last_use(uid)))
        return chosen

    def cooling(self, uid: int, quota: Quota, now: float) -> dict[str, float]:
        """The kinds of unit (policy.unit_kind) the user is given none of now, after a time limit
        took one (policy.cool_downs): kind -> when that ends."""
        return policy.cool_downs(quota, now, self.store.time_limited(uid))

    def kind_of(self, unit: int) -> str:
        """policy.unit_kind of a unit this server has ('' for one it no longer has)."""
        gpu = self.gpus.get(unit, self.physical.get(unit))
        return "" if gpu is None else policy.unit_kind(gpu)

    def note_time_limit(self, uid: int, taken: Iterable[Grant], now: float) -> None:
        """A time limit took these grants: the user's cool-down for their kinds starts now."""
        self.store.note_time_limited(uid, {self.kind_of(grant.unit) for grant in taken}, now)

    def _used_at(self, grant: Grant) -> float:
        """When a process of its user was last on a grant's unit, as the freshest memory says."""
        seen = None if self.last_seen is None else self.last_seen(grant.uid, grant.unit)
        return grant.last_active if seen is None else max(grant.last_active, seen)

    def add(self, uid: int, user: str, units: Iterable[int], now: float, *, expires_at: float | None,
            shared: bool, origin: Origin, message: str, memory: int | None = None,
            last_active: float | None = None) -> None:
        """memory: a shared grant's memory quota per GPU, what the allocator counts against the
        GPU's memory when others share it too (None: unknown, so nobody joins); last_active: where
        its idle clock starts (now when not given: an admin's grant)."""
        units = sorted(units)
        if not units:
            return
        before = self._entries(self.store.grants(uid)) if self.gate else set()  # what the gate had opened
        self.store.add_grants(uid, user, units, now, expires_at, shared=shared, origin=origin,
                              uuids={m: self.gpus[m].uuid for m in units if m in self.gpus}, memory=memory,
                              last_active=last_active)
        try:
            if self.gate:
                for _, device in sorted(self._entries(self.store.grants(uid)) - before):
                    self.gate.grant(uid, device)
            self.sync_nodes(units)
        except Exception:
            # Not enforceable: take it back, so the store never claims what the kernel does not do.
            self.remove(uid, units, now, kind=EventKind.ERROR, rule=Rule(origin), message="grant could not be applied")
            raise
        self.store.add_events(Event(now, uid, user, EventKind.GRANT, message, unit=unit, rule=Rule(origin),
                                    action=EventKind.GRANT) for unit in units)
        event(logging.INFO, "grant", user=user, uid=uid, gpu=unit_list(units), origin=origin, expires_at=expires_at,
              shared=shared or None)
        self.write_visible_devices(uid)

    def remove(self, uid: int, units: Iterable[int] | None, now: float, *, kind: EventKind, rule: Rule,
               message: str) -> list[Grant]:
        """Take back a user's GPUs (all, or these units) from the gate, the store and the ACLs, and
        record it. kind: release, revoke, error (a grant that could not be applied). Returns what
        was held. Only that: release.Releases.take_back is the whole step (holders, fair share,
        queue), which every path that takes grants back goes through."""
        wanted = None if units is None else set(units)
        everything = self.store.grants(uid)
        held = [g for g in everything if wanted is None or g.unit in wanted]
        if not held:
            return []
        kept = [g for g in everything if wanted is not None and g.unit not in wanted]
        closed: list[Device] = []
        try:
            if self.gate:
                for _, device in sorted(self._entries(held) - self._entries(kept)):
                    self.gate.revoke(uid, device)
                    closed.append(device)
            # An idle release starts its user afresh (policy.idle_since); any other end is carried over.
            carried = None if rule in (Rule.IDLE, Rule.RECLAIM) else max(map(self._used_at, held))
            self.store.remove_grants(uid, [g.unit for g in held], now, last_use=carried)
        except Exception:
            # The store still has these grants: reopen the gate for them, so both agree again.
            for device in closed:
                assert self.gate is not None  # only the gate closed anything
                self.gate.grant(uid, device)
            raise
        self.sync_nodes(g.unit for g in held)
        self.store.add_events(Event(now, uid, grant.user, kind, message, unit=grant.unit, rule=rule, action=kind)
                              for grant in held)
        event(logging.INFO, kind, user=held[0].user, uid=uid, gpu=unit_list(g.unit for g in held), rule=rule)
        self.write_visible_devices(uid)
        return held

    def sync_nodes(self, units: Iterable[int]) -> list[str]:
        """Make the nodes of these units (devices_of) exist, 0660 root:root, with an ACL entry for
        exactly the users whose grants reach them and the exempt users; returns what was wrong.
        GPUs this machine no longer has are skipped: no node to manage."""
        units = list(units)
        devices = {device for unit in units for device in self.devices_of(unit)}
        parents = {unit_parent(unit) for unit in units}  # a grant's nodes are all on its own GPU
        users: dict[Device, set[int]] = {}
        for grant in self.store.grants_on(parents):
            for device in self.devices_of(grant.unit):
                users.setdefault(device, set()).add(grant.uid)
        fixed = []
        for device in sorted(devices):
            if device[0] != NVIDIA_MAJOR or device[1] in self.minors:
                fixed += self.nodes.sync(device, users.get(device, set()) | self.exempt)
        return fixed

    def _all_units(self) -> set[int]:
        return set(self.minors) | set(self.gpus) | {g.unit for g in self.store.grants()}

    def node_changed(self, path: Path | None) -> None:
        """NodeWatcher callback: a node was (re)created or changed; None means check them all."""
        if path is None:
            self.sync_nodes(self._all_units())
        elif match := _NODE.fullmatch(path.name):
            self.sync_nodes([int(match[1])])
        elif _CAP_NODE.fullmatch(path.name):
            self.sync_nodes(unit for unit in self._all_units() if is_slice(unit))

    def update_layout(self, now_seen: MigLayout) -> dict[Grant, str]:
        """Follow the MIG layout NVML shows now (NvmlBackend.layout()): the new slices become what
        can be handed out, so that what the revokes free goes to the queue from the layout of now.
        Returns every grant the layout ends, with why (gpuguard.core.layout.stale, asked of the store
        each time, so grants left from before a restart end too): the caller revokes them
        (Releases.follow_layout), closed with the capability nodes they had, whose minors stay
        known here."""
        physical = {minor: replace(gpu, mig_mode=minor in now_seen.mig_gpus) if minor not in now_seen.unread else gpu
                    for minor, gpu in self.physical.items()}
        kept = [gpu for gpu in self.gpus.values() if gpu.slice is not None and gpu.slice.parent in now_seen.unread]
        units = layout.grantable(physical.values(), [*now_seen.slices, *kept])
        # the same units, by UUID (their memory in use is not the layout)
        changed = {u: gpu.uuid for u, gpu in units.items()} != {u: gpu.uuid for u, gpu in self.gpus.items()}
        learned = {unit for unit, gpu in units.items() if gpu.slice is not None and unit not in self._caps}
        if changed:
            self.physical = physical
            self._set_units(units)
            event(logging.INFO, "mig_layout", gpu=unit_list(now_seen.mig_gpus), slices=len(now_seen.slices))
        stale = layout.stale(self.store.grants(), units, set(physical) - now_seen.unread)
        if changed:
            self.sync_nodes(unit for unit in units if is_slice(unit))
        if learned and self.gate:  # grants on slices whose capabilities were not known until now
            reached = [g for g in self.store.grants() if g.unit in learned and g not in stale]
            for uid, device in sorted(self._entries(reached)):
                self.gate.grant(uid, device)
        return stale

    def reconcile(self) -> list[str]:
        """Rebuild the derived state from the store: gate entries exactly as granted, every node
        synced. Returns what was wrong, one line each (empty: all was right)."""
        repaired = []
        if self.gate:
            removed, added = self.gate.set_entries(self._entries(self.store.grants()))
            if removed:
                repaired.append(f"gate {self.gate.name}: map held grants the store does not: {_entries(removed)}")
            if added:
                repaired.append(f"gate {self.gate.name}: map lacked grants the store has: {_entries(added)}")
        return repaired + self.sync_nodes(self._all_units())

    def check_and_repair(self) -> list[str]:
        """Enforcement that checks and repairs itself (the daemon calls this every few ticks and
        logs each line): the gate loaded, attached to the cgroup v2 root, pinned and running the
        program for the device ranges managed now (so an nvidia-caps module loaded since start is
        managed: Gate.repair), its exempt and grants maps as configured and as the store says, and
        every GPU node's owner, mode and ACL. Returns one line per thing that was wrong and is now
        repaired; empty when everything was right. Raises GateError or OSError when a repair fails."""
        repaired = []
        if self.gate:
            repaired += [f"gate {self.gate.name}: {problem}" for problem in self.gate.repair(self.exempt)]
            if changed := self.gate.set_exempt(self.exempt):
                repaired.append(f"gate {self.gate.name}: exempt uids differed from the configured ones: "
                                f"{sorted(changed)}")
        return repaired + self.reconcile()


def _entries(entries: Iterable[Entry]) -> str:
    return ", ".join(f"uid {uid} {major}:{minor}" for uid, (major, minor) in sorted(entries))
