"""Fakes for driving Api and Watcher without root, a daemon or GPUs: the services they are built with.

The store is real (SQLite in a temporary directory needs no privilege); the device nodes,
NSS, the GPU sample and the terminals are fakes that record what was asked of them.
"""
from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuguard.api import Api
from gpuguard.backends.accounts import Account, UnknownUser
from gpuguard.config import AccessConfig, Config
from gpuguard.exempt import Exempt
from gpuguard.grants import Grants
from gpuguard.logout import LogoutRelease
from gpuguard.model import Gpu, GpuProcess, Quota
from gpuguard.backends.procfs import ProcessIdentity
from gpuguard.sampling import Holder, Sample
from gpuguard.server import Peer
from gpuguard.store import Store
from gpuguard.watcher import Watcher

GROUP = "gpugroup"


def gpu(minor: int) -> Gpu:
    return Gpu(index=minor, minor=minor, uuid=f"GPU-{minor:04d}", name="Fake H100", pci_bus_id=f"0000:{minor:02x}:00.0",
               memory_total=80 << 30, memory_used=0, numa_node=minor // 2, utilization=0)


class FakeNodes:
    """Records the ACL users each node was last given."""

    def __init__(self) -> None:
        self.users: dict[int, frozenset[int]] = {}

    def path(self, minor: int) -> Path:
        return Path(f"/nonexistent/nvidia{minor}")

    def sync(self, minor: int, users: Collection[int]) -> None:
        self.users[minor] = frozenset(users)


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
        self.set([])

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


@dataclass
class World:
    """Every service, wired as the daemon wires them."""

    tmp: Path
    config: Config = field(default_factory=lambda: Config(access=AccessConfig(group=GROUP), defaults=Quota(gpus=1)))
    holders: list[Holder] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = Store(self.tmp / "state.db")
        self.nodes = FakeNodes()
        self.grants = Grants(self.store, None, self.nodes, range(4), gpus={m: gpu(m) for m in range(4)})
        self.exempt = Exempt(lambda: self.config.access, self.store, self.grants.set_exempt)
        self.lookup = FakeLookup()
        self.sampler = FakeSampler()
        self.notifier = FakeNotifier()
        self.logout = LogoutRelease(self.store, self.grants, lambda minors: [h for h in self.holders if h.minor in minors])
        self.reloads = 0
        self.api = Api(lambda: self.config, self.store, self.grants, self.exempt, self.sampler,  # type: ignore[arg-type]
                       self.lookup, self.logout, None, reload=self._reload, sync_nodes=lambda: None)
        self.watcher = Watcher(lambda: self.config, self.store, self.grants, self.exempt, self.sampler,  # type: ignore[arg-type]
                               self.lookup, self.notifier)

    def _reload(self) -> Config:
        self.reloads += 1
        return self.config

    def quota(self, **fields: object) -> None:
        self.config = replace(self.config, defaults=replace(self.config.defaults, **fields))

    def call(self, op: str, uid: int = 0, **fields: object) -> dict:
        return asyncio.run(self.api.handle({"op": op, **fields}, Peer(pid=1, uid=uid, gid=uid)))

    def login(self, account: Account, pid: int = 4242) -> dict:
        return self.call("session_open", user=account.name, pid=pid, service="sshd", tty="pts/1")

    def held(self, uid: int) -> list[int]:
        return [g.minor for g in self.store.grants(uid)]
