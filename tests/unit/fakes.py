"""Fakes for driving Api and Watcher without root, a daemon or GPUs: the services they are built with.

The store is real (SQLite in a temporary directory needs no privilege); the device nodes,
NSS, the GPU sample and the terminals are fakes that record what was asked of them.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuguard.api import Api
from gpuguard.backends import GateError
from gpuguard.backends.accounts import Account, UnknownUser
from gpuguard.backends.procfs import ProcessIdentity
from gpuguard.config import AccessConfig, Config
from gpuguard.exempt import Exempt
from gpuguard.grants import Grants
from gpuguard.holders import HolderEnder
from gpuguard.logout import LogoutRelease
from gpuguard.model import NVIDIA_MAJOR, Gpu, GpuProcess, MigSlice, Quota, slice_unit
from gpuguard.queueing import Queue
from gpuguard.sampling import Holder, Sample
from gpuguard.scans import Scans
from gpuguard.server import Peer
from gpuguard.store import Store
from gpuguard.watcher import Watcher

GROUP = "gpugroup"


CAPS_MAJOR = 120  # of the MIG capability nodes


def gpu(minor: int, mig_mode: bool = False) -> Gpu:
    return Gpu(index=minor, minor=minor, uuid=f"GPU-{minor:04d}", name="Fake H100", pci_bus_id=f"0000:{minor:02x}:00.0",
               memory_total=80 << 30, memory_used=0, numa_node=minor // 2, utilization=0, mig_mode=mig_mode)


def mig_slice(parent: int, gi: int, profile: str = "1g.10gb", uuid: str = "", ci: int = 0) -> Gpu:
    """A MIG slice of GPU `parent`, its capability minors numbered as the driver's mig-minors does."""
    gib = int(profile.split(".")[1].removesuffix("gb"))
    caps = (3 + parent * 135 + gi * 9, 3 + parent * 135 + gi * 9 + 1 + ci)
    return Gpu(index=parent, minor=slice_unit(parent, gi, ci), uuid=uuid or f"MIG-{parent}-{gi}-{ci}",
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
        self.entries: set[tuple[int, tuple[int, int]]] = set()
        self.failing: set[int] = set()

    def grant(self, uid: int, device: tuple[int, int]) -> None:
        self._check(uid)
        self.entries.add((uid, device))

    def revoke(self, uid: int, device: tuple[int, int]) -> None:
        self._check(uid)
        self.entries.discard((uid, device))

    def set_entries(self, wanted: Iterable[tuple[int, tuple[int, int]]]) -> tuple[set, set]:
        wanted = set(wanted)
        removed, added = self.entries - wanted, wanted - self.entries
        self.entries = wanted
        return removed, added

    def _check(self, uid: int) -> None:
        if uid in self.failing:
            raise GateError(f"gate fake: map update refused for uid {uid}")


class FakeLookup:
    """NSS as a dict of accounts."""

    def __init__(self, accounts: Iterable[Account] = ()):
        self.accounts = {a.name: a for a in accounts}

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


class FakeSampler:
    """Hands out the sample a test set; `processes` as (pid, uid, minor, bytes)."""

    def __init__(self) -> None:
        self.last: Sample | None = None
        self.errors: Counter[str] = Counter()  # NVML errors by GPU, as the real Sampler counts them
        self.names: dict[int, str] = {}  # pid -> process name, for status
        self.set([])

    async def commands(self, pids: Iterable[int]) -> dict[int, str]:
        return {pid: self.names.get(pid, "") for pid in pids}

    def set(self, processes: Iterable[tuple[int, int, int, int | None]], minors: Collection[int] = range(4)) -> Sample:
        procs = tuple(GpuProcess(pid, minor, used) for pid, _, minor, used in processes)
        owners = {pid: ProcessIdentity(pid, uid, 1000 + pid) for pid, uid, _, _ in processes}
        self.last = Sample(0.0, procs, owners, frozenset(minors))
        return self.last

    async def take(self, max_age: float = 0) -> Sample:
        assert self.last is not None
        return self.last

    async def take_or_log(self, action: str, max_age: float = 0, **fields: object) -> Sample | None:
        return self.last


class FakeNotifier:
    def __init__(self) -> None:
        self.told: list[tuple[str, str]] = []

    def tell(self, user: str, uid: int, message: str, ttys: Iterable[str] = ()) -> None:
        self.told.append((user, message))


class FakeExits:
    """backends.exits.ExitWatch without processes: `exit(pid)` says a watched process ended."""

    def __init__(self) -> None:
        self.watched: dict[int, tuple[Collection[int], Callable[[], None]]] = {}  # uid -> its watch

    def watch(self, pids: Collection[int], uid: int, on_exit: Callable[[], None]) -> Callable[[], None]:
        self.watched[uid] = (pids, on_exit)
        return lambda: self.watched.pop(uid, None)

    def exit(self, pid: int) -> None:
        for pids, on_exit in list(self.watched.values()):
            if pid in pids:
                on_exit()


@dataclass
class World:
    """Every service, wired as the daemon wires them."""

    tmp: Path
    config: Config = field(default_factory=lambda: Config(access=AccessConfig(group=GROUP), defaults=Quota(gpus=1)))
    holders: list[Holder] = field(default_factory=list)
    scans: int = 0  # /proc scans asked for
    scanned_uids: list = field(default_factory=list)  # whose processes each scan read
    gpus: list[Gpu] = field(default_factory=lambda: [gpu(m) for m in range(4)])  # GPUs and MIG slices
    gate: FakeGate | None = None  # None: acl mode

    def __post_init__(self) -> None:
        self.store = Store(self.tmp / "state.db")
        self.nodes = FakeNodes()
        self.grants = Grants(self.store, self.gate, self.nodes, range(4),  # type: ignore[arg-type]
                             gpus={g.minor: g for g in self.gpus}, caps_major=CAPS_MAJOR)
        self.exempt = Exempt(lambda: self.config.access, self.store, self.grants.set_exempt)
        self.lookup = FakeLookup()
        self.sampler = FakeSampler()
        self.notifier = FakeNotifier()
        self.exits = FakeExits()
        self.scanning = Scans(self.find_holders)
        self.logout = LogoutRelease(self.store, self.grants, self.scanning, self.exits)  # type: ignore[arg-type]
        self.holder_ender = HolderEnder(self.scanning, self.sampler, self.exempt, self.store,  # type: ignore[arg-type]
                                        lambda: self.config.watcher.kill_wait)
        self.grants.holders = self.holder_ender
        self.reloads = 0
        self.queue = Queue(lambda: self.config, self.store, self.grants)
        self.watcher = Watcher(lambda: self.config, self.store, self.grants, self.exempt, self.sampler,  # type: ignore[arg-type]
                               self.lookup, self.notifier, demand=self.queue.demand)
        self.api = Api(lambda: self.config, self.store, self.grants, self.exempt, self.sampler,  # type: ignore[arg-type]
                       self.lookup, self.logout, self.holder_ender, None, reload=self._reload,
                       sync_nodes=lambda: None, account_of=self.watcher.account_of, flush_usage=self.watcher.flush_usage,
                       queue=self.queue, notifier=self.notifier)  # type: ignore[arg-type]

    def find_holders(self, minors: Collection[int], uids: Collection[int]) -> list[Holder]:
        """The /proc scan: the holders a test listed, on those GPUs, of those users; counted."""
        self.scans += 1
        self.scanned_uids.append(frozenset(uids))
        return [h for h in self.holders if h.minor in minors and h.uid in uids]

    def _reload(self) -> Config:
        self.reloads += 1
        return self.config

    def quota(self, **fields: object) -> None:
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
        return [g.minor for g in self.store.grants(uid)]
