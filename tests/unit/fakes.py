"""Fakes for driving Api and Watcher without root, a daemon or GPUs: the services they are built with.

The store is real (SQLite in a temporary directory needs no privilege); the device nodes,
NSS, the GPU sample and the terminals are fakes that record what was asked of them.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuguard.backends import GateError
from gpuguard.config import AccessConfig, Config
from gpuguard.core.errors import UnknownUser
from gpuguard.core.model import (
    NVIDIA_MAJOR,
    Account,
    Device,
    Gpu,
    GpuProcess,
    MigSlice,
    ProcessIdentity,
    Quota,
    SignalOutcome,
    SignalResult,
    slice_unit,
)
from gpuguard.core.sample import Opener, Sample
from gpuguard.daemon import wiring as front
from gpuguard.daemon.server import Peer
from gpuguard.fleet.fencing import Lineage
from gpuguard.services import wiring

GROUP = "gpugroup"


CAPS_MAJOR = 120  # of the MIG capability nodes


def gpu(minor: int, mig_mode: bool = False) -> Gpu:
    return Gpu(index=minor, unit=minor, uuid=f"GPU-{minor:04d}", name="Fake H100", pci_bus_id=f"0000:{minor:02x}:00.0",
               memory_total=80 << 30, memory_used=0, numa_node=minor // 2, utilization=0, mig_mode=mig_mode)


def mig_slice(parent: int, gi: int, profile: str = "1g.10gb", uuid: str = "", ci: int = 0) -> Gpu:
    """A MIG slice of GPU `parent`, its capability minors numbered as the driver's mig-minors does."""
    gib = int(profile.split(".")[1].removesuffix("gb"))
    caps = (3 + parent * 135 + gi * 9, 3 + parent * 135 + gi * 9 + 1 + ci)
    return Gpu(index=parent, unit=slice_unit(parent, gi, ci), uuid=uuid or f"MIG-{parent}-{gi}-{ci}",
               name=f"Fake H100 MIG {profile}", pci_bus_id=f"0000:{parent:02x}:00.0", memory_total=gib << 30,
               memory_used=0, numa_node=parent // 2, utilization=None,
               slice=MigSlice(parent, gi, ci, profile, caps))


class FakeNodes:
    """Records the ACL users each node was last given: `users` for the GPU nodes by minor,
    `devices` for every node by (major, minor)."""

    def __init__(self) -> None:
        self.devices: dict[tuple[int, int], frozenset[int]] = {}

    @property
    def users(self) -> dict[int, frozenset[int]]:
        return {minor: users for (major, minor), users in self.devices.items() if major == NVIDIA_MAJOR}

    def sync(self, device: tuple[int, int], users: Collection[int]) -> list[str]:
        changed = self.devices.get(device) != frozenset(users)
        self.devices[device] = frozenset(users)
        return [f"{device[0]}:{device[1]}: ACL users"] if changed else []


class FakeGate:
    """The gate's map as a set of (uid, (major, minor)) entries; `failing` uids make grant and revoke raise."""

    name = "fake"

    def __init__(self) -> None:
        self.entries_now: set[tuple[int, Device]] = set()
        self.exempt_now: set[int] = {0}
        self.failing: set[int] = set()

    def entries(self) -> set[tuple[int, Device]]:
        return set(self.entries_now)

    def exempt(self) -> set[int]:
        return set(self.exempt_now)

    def set_exempt(self, uids: Iterable[int]) -> set[int]:
        wanted = set(uids) | {0}
        changed, self.exempt_now = wanted ^ self.exempt_now, wanted
        return changed

    def is_attached(self) -> bool:
        return True

    def repair(self, exempt_uids: Iterable[int]) -> list[str]:
        return []

    def grant(self, uid: int, device: tuple[int, int]) -> None:
        self._check(uid)
        self.entries_now.add((uid, device))

    def revoke(self, uid: int, device: tuple[int, int]) -> None:
        self._check(uid)
        self.entries_now.discard((uid, device))

    def set_entries(self, wanted: Iterable[tuple[int, Device]]) -> tuple[set[tuple[int, Device]],
                                                                          set[tuple[int, Device]]]:
        target = set(wanted)
        removed, added = self.entries_now - target, target - self.entries_now
        self.entries_now = target
        return removed, added

    def _check(self, uid: int) -> None:
        if uid in self.failing:
            raise GateError(f"gate fake: map update refused for uid {uid}")


class FakeLookup:
    """NSS as a dict of accounts; `exempt` the uids the exempt groups' member lists name."""

    def __init__(self, accounts: Iterable[Account] = ()):
        self.accounts = {a.name: a for a in accounts}
        self.exempt: set[int] = set()

    def add(self, name: str, uid: int, *groups: str) -> Account:
        self.accounts[name] = Account(name, uid, frozenset(groups))
        return self.accounts[name]

    async def by_name(self, name: str) -> Account:
        if name not in self.accounts:
            raise UnknownUser(f"no such user: {name}")
        return self.accounts[name]

    async def by_uid(self, uid: int) -> Account:
        for account in self.accounts.values():
            if account.uid == uid:
                return account
        raise UnknownUser(f"no user with uid {uid}")

    async def exempt_uids(self, access: AccessConfig, logged_in: Collection[int]) -> frozenset[int]:
        groups = set(access.exempt_groups)
        by_groups = {a.uid for a in self.accounts.values() if a.uid in logged_in and a.groups & groups}
        return frozenset({0} | self.exempt | by_groups)

    def close(self) -> None:
        pass


class FakeSampler:
    """Hands out the sample a test set; `processes` as (pid, uid, unit, bytes)."""

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()  # NVML errors by GPU, as the real Sampler counts them
        self.names: dict[int, str] = {}  # pid -> process name, for status
        self.last: Sample = self.set([])  # always a sample: the tests hand it to Watcher.check as the daemon does

    async def commands(self, pids: Iterable[int]) -> dict[int, str]:
        return {pid: self.names.get(pid, "") for pid in pids}

    def set(self, processes: Iterable[tuple[int, int, int, int | None]], units: Collection[int] = range(4)) -> Sample:
        procs = tuple(GpuProcess(pid, unit, used) for pid, _, unit, used in processes)
        owners = {pid: ProcessIdentity(pid, uid, 1000 + pid) for pid, uid, _, _ in processes}
        self.last = Sample(0.0, procs, owners, frozenset(units))
        return self.last

    async def take(self, max_age: float = 0) -> Sample:
        return self.last

    async def take_or_log(self, action: str, max_age: float = 0, **fields: object) -> Sample | None:
        return self.last


class FakeNotifier:
    def __init__(self) -> None:
        self.told: list[tuple[str, str]] = []

    def tell(self, user: str, uid: int, message: str, ttys: Iterable[str] = ()) -> None:
        self.told.append((user, message))

    def close(self) -> None:
        pass


class FakeVisibleDevices:
    """backends.visible_devices.VisibleDevicesFiles without files: what each user's file would say now (no key: no file)."""

    def __init__(self) -> None:
        self.files: dict[int, list[str]] = {}
        self.writes = 0

    def write(self, uid: int, uuids: Sequence[str]) -> None:
        self.writes += 1
        if uuids:
            self.files[uid] = list(uuids)
        else:
            self.files.pop(uid, None)

    def users(self) -> set[int]:
        return set(self.files)


class FakeProcesses:
    """The processes the sample names, as the sampler saw them (their identities); a signal to one
    of them is recorded and delivered (`signals`), to any other pid it finds nobody (GONE)."""

    def __init__(self, sampler: FakeSampler) -> None:
        self.sampler = sampler
        self.signals: list[tuple[int, int]] = []  # (pid, signal) delivered
        self.states: dict[int, str] = {}  # pid -> state shown for an unkillable process

    def identity(self, pid: int) -> ProcessIdentity | None:
        return self.sampler.last.owners.get(pid)

    def command(self, pid: int) -> str:
        return self.sampler.names.get(pid, "")

    def state(self, identity: ProcessIdentity) -> str | None:
        return self.states.get(identity.pid)

    def send(self, identity: ProcessIdentity, sig: int, exempt: Collection[int] = ()) -> SignalResult:
        if self.identity(identity.pid) != identity:
            return SignalResult(SignalOutcome.GONE, "no such process")
        if identity.uid in exempt or identity.uid == 0:
            return SignalResult(SignalOutcome.REFUSED, "root or exempt process")
        self.signals.append((identity.pid, sig))
        return SignalResult(SignalOutcome.SENT)


class FakeExits:
    """backends.exits.ExitWatch without processes: `exit(pid)` says a watched process ended."""

    def __init__(self) -> None:
        self.watched: dict[int, tuple[Collection[int], Callable[[], None]]] = {}  # uid -> its watch

    def watch(self, pids: Collection[int], uid: int, on_exit: Callable[[], None]) -> Callable[[], None] | None:
        self.watched[uid] = (pids, on_exit)
        return lambda: self.stop(uid)

    def stop(self, uid: int) -> None:
        self.watched.pop(uid, None)

    def exit(self, pid: int) -> None:
        for pids, on_exit in list(self.watched.values()):
            if pid in pids:
                on_exit()


class FakeFleetDb:
    """The fleet's PostgreSQL as a node calls it (edges.FleetDatabase): records each call in the order
    it reached the database; `allow` caps the GPUs a user may take (absent: all they ask for)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.allow: dict[str, int] = {}
        self.lineage: Lineage | None = None  # not fenced

    def heartbeat(self, doc: dict[str, Any], kept_from: int | None = None) -> dict[str, Any]:
        self.calls.append(("heartbeat", doc))
        return {"usage": {}, "held": {}, "free": []}

    def reserve(self, doc: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("reserve", (doc["user"], tuple(doc["minors"]))))
        granted = doc["minors"][:self.allow.get(doc["user"], len(doc["minors"]))]
        return {"granted": granted, "held": len(granted)}

    def release(self, pairs: list[tuple[int, str]]) -> None:
        self.calls.append(("release", sorted(pairs)))

    def close(self) -> None:
        self.calls.append(("close", None))


@dataclass
class World:
    """Every service, wired by wiring.build as the daemon wires them, over the fake edges."""

    tmp: Path
    config: Config = field(default_factory=lambda: Config(access=AccessConfig(group=GROUP), defaults=Quota(gpus=1)))
    openers: list[Opener] = field(default_factory=list)
    scans: int = 0  # /proc scans asked for
    scanned_uids: list = field(default_factory=list)  # whose processes each scan read
    gpus: list[Gpu] = field(default_factory=lambda: [gpu(m) for m in range(4)])  # GPUs and MIG slices
    gate: FakeGate | None = None  # None: acl mode
    fleet_db: FakeFleetDb | None = None  # a fleet's database (config.fleet set too); None: a single server
    foreign: list[dict[str, Any]] = field(default_factory=list)  # status entries of Slurm's/Kubernetes' GPUs

    def __post_init__(self) -> None:
        self.nodes = FakeNodes()
        self.lookup = FakeLookup()
        self.sampler = FakeSampler()
        self.notifier = FakeNotifier()
        self.exits = FakeExits()
        self.processes = FakeProcesses(self.sampler)
        self.visible_devices = FakeVisibleDevices()
        self.reloads = 0
        self.services = wiring.build(wiring.Edges(
            config=lambda: self.config, store_path=self.tmp / "state.db", sampler=self.sampler,
            units={g.unit: g for g in self.gpus}, driver_minors=range(4), nodes=self.nodes, lookup=self.lookup,
            terminals=self.notifier, exits=self.exits, find_openers=self.find_openers, processes=self.processes,
            gate=self.gate, caps_major=CAPS_MAJOR, foreign=self.foreign,
            fleet_db=self.fleet_db, visible_devices=self.visible_devices))
        self.front = front.build(self.services, reload=self._reload)
        s = self.services
        self.store, self.grants, self.exempt, self.queue = s.store, s.grants, s.exempt, s.queue
        self.drains, self.holds = s.drains, s.holds
        self.watcher, self.api, self.logout, self.opener_ender = s.watcher, self.front.api, s.logout, s.openers

    def find_openers(self, units: Iterable[int], uids: Collection[int] | None,
                     devices_of: Callable[[int], Iterable[Device]]) -> list[Opener]:
        """The /proc scan: the openers a test listed, on those GPUs, of those users; counted."""
        self.scans += 1
        self.scanned_uids.append(None if uids is None else frozenset(uids))  # None: a walk of all of /proc
        wanted = set(units)
        return [h for h in self.openers if h.unit in wanted and (uids is None or h.uid in uids)]

    def _reload(self) -> Config:
        self.reloads += 1
        return self.config

    def quota(self, **fields: Any) -> None:
        self.config = replace(self.config, defaults=replace(self.config.defaults, **fields))

    def call(self, op: str, uid: int = 0, **fields: object) -> dict:
        """The reply, once what the call started in the background (a check after logout) has ended."""
        async def call() -> dict:
            reply = await self.api.handle({"op": op, **fields}, Peer(pid=1, uid=uid, gid=uid))
            await self.logout.settled()
            return reply
        return asyncio.run(call())

    def login(self, account: Account, pid: int = 4242) -> dict:
        return self.call("session_open", user=account.name, pid=pid, service="sshd", tty="pts/1")

    def held(self, uid: int) -> list[int]:
        return [g.unit for g in self.store.grants(uid)]
