"""The edges the services are built from, as typing.Protocols: what the GPUs, the gate, the device
nodes, NSS, the terminals, the processes, the clock and a fleet's database must offer the services (wiring.build).

The daemon passes the real ones (backends/), the unit tests fakes (tests/unit/fakes.py) and a
replay virtual ones; mypy checks each of them against these, so a fake cannot drift from the
real class. Nothing here runs: the types only.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gpuguard.config import AccessConfig
    from gpuguard.core.model import Account, Device, ProcessIdentity, SignalResult
    from gpuguard.core.sample import Opener, Sample
    from gpuguard.fleet.fencing import Lineage

Clock = Callable[[], float]  # wall-clock seconds: time.time, or a replay's virtual clock
Cancel = Callable[[], None]
Entry = tuple[int, "Device"]  # (uid, (major, minor)): one grant in the gate's map


class GpuSampler(Protocol):
    """Samples of the GPUs (backends.sampler.Sampler over NVML or the simulated GPUs)."""

    @property
    def last(self) -> Sample | None: ...

    @property
    def errors(self) -> Mapping[str, int]: ...  # NVML errors since start by GPU, "all" for whole samples

    async def take(self, max_age: float = ...) -> Sample: ...

    async def take_or_log(self, action: str, max_age: float = ..., **fields: Any) -> Sample | None: ...

    async def commands(self, pids: Iterable[int]) -> dict[int, str]: ...


class GateMap(Protocol):
    """The device gate's maps and program (backends.gate.Gate); None in access.mode = acl."""

    @property
    def name(self) -> str: ...

    def grant(self, uid: int, dev: Device) -> None: ...

    def revoke(self, uid: int, dev: Device) -> None: ...

    def entries(self) -> set[Entry]: ...

    def set_entries(self, wanted: Iterable[Entry]) -> tuple[set[Entry], set[Entry]]: ...

    def exempt(self) -> set[int]: ...

    def set_exempt(self, uids: Iterable[int]) -> set[int]: ...

    def is_attached(self) -> bool: ...

    def repair(self, exempt_uids: Iterable[int]) -> list[str]: ...


class Nodes(Protocol):
    """The device nodes of GPUs and MIG capabilities (backends.gpu_nodes.AclNodes on a real machine)."""

    def sync(self, device: Device, users: Collection[int]) -> list[str]:
        """Make the node exist, 0660 root:root, with an ACL entry for exactly `users`;
        returns what was wrong (empty when the node was right and nothing was written)."""


class Lookup(Protocol):
    """NSS, off the event loop and bounded in time (lookups.AccountLookup)."""

    async def by_name(self, name: str) -> Account: ...

    async def by_uid(self, uid: int) -> Account: ...

    async def exempt_uids(self, access: AccessConfig, logged_in: Collection[int]) -> frozenset[int]: ...

    def close(self) -> None: ...


class Terminals(Protocol):
    """Telling users on their terminals (backends.notify.Notifier)."""

    def tell(self, user: str, uid: int, message: str, ttys: Iterable[str] = ()) -> None: ...

    def close(self) -> None: ...


class ExitWatch(Protocol):
    """Being told when processes exit (backends.exits.ExitWatch)."""

    def watch(self, pids: Collection[int], uid: int, on_exit: Callable[[], None]) -> Cancel | None: ...


class OpenerSearch(Protocol):
    """Processes of these users (None: anyone's, a walk of all of /proc) holding these units' nodes
    (backends.sampler.node_openers: a /proc scan, blocking, run in scans.Scans' pools). devices_of: the
    nodes whose holders use a unit."""

    def __call__(self, units: Iterable[int], uids: Collection[int] | None,
                 devices_of: Callable[[int], Iterable[Device]]) -> list[Opener]: ...


class Processes(Protocol):
    """Who a process is and signalling it safely (backends.processes.HostProcesses: /proc and pidfds)."""

    def identity(self, pid: int) -> ProcessIdentity | None: ...

    def command(self, pid: int) -> str: ...

    def state(self, identity: ProcessIdentity) -> str | None: ...

    def send(self, identity: ProcessIdentity, sig: int, exempt: Collection[int] = ()) -> SignalResult: ...


class FleetDatabase(Protocol):
    """The fleet's PostgreSQL as a node calls it (gpuguard.fleet.fleetdb.FleetDb), from one
    thread at a time; each call one round trip, raising psycopg.Error when it fails (or
    fencing.Fenced, for a database this node must not write to)."""

    lineage: Lineage | None  # the database the last connection reached (None: not known, or not fenced)

    def heartbeat(self, doc: dict[str, Any], kept_from: int | None = None) -> dict[str, Any]:
        """The first on each connection adds `ledger_present`: the outbox's seqs from kept_from on it has."""

    def reserve(self, doc: dict[str, Any]) -> dict[str, Any]: ...

    def release(self, pairs: list[tuple[int, str]]) -> None:
        """No round trip of its own: sent in front of the next call, heartbeat or reserve."""

    def close(self) -> None: ...


class VisibleDevices(Protocol):
    """Each user's held GPUs (UUIDs) where the PAM module finds them when no daemon answers
    (backends.visible_devices.VisibleDevicesFiles: /run/gpuguard/held/UID)."""

    def write(self, uid: int, uuids: Sequence[str]) -> None:
        """Say these UUIDs for uid (none: the user's file goes); a failure is logged, never raised."""

    def users(self) -> set[int]:
        """The uids with a file now."""
