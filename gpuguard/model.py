"""The nouns of gpuguard as frozen dataclasses, shared by the pure core and the backends.

GPUs are identified by their minor number (the N of /dev/nvidiaN), never by NVML index:
the index can differ from the minor and is not what the kernel checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from gpuguard.compat import StrEnum

NVIDIA_MAJOR = 195


class Link(IntEnum):
    """How well two GPUs are connected; lower is better (the allocator minimises it)."""

    NVLINK = 0
    PCIE_SWITCH = 1   # behind the same PCIe switch
    NUMA_NODE = 2     # same CPU socket / host bridge
    SYSTEM = 3        # across sockets


class Origin(StrEnum):
    """Where a grant (or a place in the queue) came from, which decides when it ends."""

    SESSION = "session"  # made while the user had a session: ends with their last one, once unused
    REQUEST = "request"  # asked with no session open (cron, systemd-run): until released or expired
    ADMIN = "admin"      # `gpuguard grant`: until released, revoked or expired


@dataclass(frozen=True)
class Quota:
    gpus: int = 1
    gpu_memory: int | None = None       # bytes per GPU; None = unlimited
    max_time: float | None = None       # seconds a grant lasts; None = no limit
    idle_timeout: float | None = None   # seconds without a process before release
    sharing: bool = False               # may share GPUs with other sharing users
    priority: int = 0                   # the queue serves higher first (gpuguard.scheduler)
    share: float = 1.0                  # fair-share weight: recent usage counts divided by it
    reclaim_after: float | None = None  # seconds without a process before release, only while someone waits


@dataclass(frozen=True)
class Gpu:
    index: int               # NVML index (for display only)
    minor: int               # /dev/nvidia<minor>: the identity gpuguard uses
    uuid: str
    name: str
    pci_bus_id: str
    memory_total: int
    memory_used: int
    numa_node: int | None
    utilization: int | None  # percent, None when NVML cannot tell

    @property
    def device(self) -> tuple[int, int]:
        return (NVIDIA_MAJOR, self.minor)


@dataclass(frozen=True)
class GpuUse:
    """How busy one GPU is at a moment (NVML's device-wide numbers, all processes together)."""

    memory_used: int         # bytes
    memory_total: int        # bytes
    utilization: int | None  # percent of the last sample period with a kernel running; None: NVML cannot tell


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    minor: int
    used_memory: int | None  # bytes; None = NVML does not know (never read as 0)


@dataclass(frozen=True)
class Grant:
    uid: int
    user: str
    minor: int
    granted_at: float
    expires_at: float | None
    last_active: float       # last time a process of the user was seen on it (idle release)
    shared: bool = False
    origin: Origin = Origin.SESSION


@dataclass(frozen=True)
class Session:
    id: int
    uid: int
    user: str
    service: str
    rhost: str
    tty: str
    pid: int
    opened_at: float


@dataclass(frozen=True)
class Event:
    """Something users and admins should be able to look back on (warnings, kills, releases)."""

    time: float
    uid: int | None
    user: str
    kind: str                 # warning | kill | release | grant | revoke | error | unkillable
    message: str
    minor: int | None = None
    pid: int | None = None
    command: str = ""
    rule: str = ""            # memory | time | idle | stray | admin | login ...
    action: str = ""          # warn | term | kill | revoke | release ...
    numbers: dict = field(default_factory=dict)
    id: int | None = None
