"""The nouns of gpuguard as frozen dataclasses, shared by the pure core and the backends.

GPUs are identified by their minor number (the N of /dev/nvidiaN), never by NVML index:
the index can differ from the minor and is not what the kernel checks.

What is handed out is a *unit*: a whole GPU, or one MIG slice of a GPU in MIG mode. A unit has
a number, and everything keyed by GPU (grants, processes, events, usage) is keyed by it: a
whole GPU's unit number is its minor; a slice's is slice_unit(parent minor, GPU instance id,
compute instance id), at or above SLICE_UNITS, so it never collides with a minor and needs no
table to say which GPU it is on. Shown to people as unit_label(): "3" or "3/gi1/ci0".
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, NamedTuple

from gpuguard.core.compat import StrEnum
from gpuguard.core.unit_numbers import CI_SLOTS as CI_SLOTS
from gpuguard.core.unit_numbers import GI_SLOTS as GI_SLOTS
from gpuguard.core.unit_numbers import SLICE_UNITS as SLICE_UNITS
from gpuguard.core.unit_numbers import is_slice as is_slice
from gpuguard.core.unit_numbers import parse_unit as parse_unit
from gpuguard.core.unit_numbers import slice_place as slice_place
from gpuguard.core.unit_numbers import slice_unit as slice_unit
from gpuguard.core.unit_numbers import unit_label as unit_label
from gpuguard.core.unit_numbers import unit_parent as unit_parent

NVIDIA_MAJOR = 195
Device = tuple[int, int]  # (major, minor) of a character device node

# A MIG profile as nvidia-smi and NVML name it: 1g.10gb, 1g.10gb+me (with a media engine),
# 1c.3g.40gb (a compute instance of one compute slice in a 3g.40gb GPU instance).
MIG_PROFILE = re.compile(r"(?:\d+c\.)?\d+g\.\d+gb(?:\+\w+)?")




@dataclass(frozen=True)
class Account:
    """A user as NSS answers (backends.accounts asks it)."""

    name: str
    uid: int
    groups: frozenset[str]  # names of the primary and all supplementary groups


class ProcessIdentity(NamedTuple):
    """A process as the kernel knows it: the pid is reused, the (pid, start_time) pair is not."""

    pid: int
    uid: int         # real uid: the one the gate's bpf_get_current_uid_gid() sees
    start_time: int  # clock ticks after boot, /proc/<pid>/stat field 22


class SignalOutcome(str, Enum):
    """What sending a signal to a ProcessIdentity came to (backends.signals.send)."""

    SENT = "sent"        # delivered to the process the identity names
    GONE = "gone"        # exited, or the pid now belongs to another process (which was not touched)
    REFUSED = "refused"  # root or exempt: never signalled


@dataclass(frozen=True)
class SignalResult:
    outcome: SignalOutcome
    detail: str = ""

    @property
    def sent(self) -> bool:
        return self.outcome is SignalOutcome.SENT


class Link(IntEnum):
    """How well two GPUs are connected; lower is better (the allocator minimises it)."""

    NVLINK = 0
    PCIE_SWITCH = 1   # behind the same PCIe switch
    NUMA_NODE = 2     # same CPU socket / host bridge
    SYSTEM = 3        # across sockets


class Placement(StrEnum):
    """How a fraction's GPU is chosen (allocator.place_fraction; [scheduler] fraction_placement)."""

    FGD = "fgd"              # the least expected fragmentation for the asks seen lately
    BEST_FIT = "best-fit"    # the GPU left with the least memory to promise
    FIRST_FIT = "first-fit"  # the lowest GPU with room


class Origin(StrEnum):
    """Where a grant (or a place in the queue) came from, which decides when it ends."""

    SESSION = "session"  # made while the user had a session: ends with their last one, once unused
    REQUEST = "request"  # asked with no session open (cron, systemd-run): until released or expired
    ADMIN = "admin"      # `gpuguard grant`: until released, revoked or expired


class EventKind(StrEnum):
    """What an event records (Event.kind): the words `gpuguard whoami`, `events` and the metrics use."""

    GRANT = "grant"
    WARNING = "warning"        # a watcher's warning or report
    KILL = "kill"              # SIGTERM or SIGKILL sent (Event.action says which)
    UNKILLABLE = "unkillable"  # still there after SIGKILL
    REVOKE = "revoke"          # taken back: an admin, a time limit, a MIG layout change
    RELEASE = "release"        # given back: the user, idle, reclaim, logout
    ERROR = "error"            # a grant that could not be applied, taken back at once


class Rule(StrEnum):
    """Why something happened (Event.rule): the watcher's rules, what else takes grants back, and
    where a grant came from (its Origin, the rule of a grant event)."""

    MEMORY = "memory"
    TIME = "time"
    IDLE = "idle"
    STRAY = "stray"
    RECLAIM = "reclaim"
    LAYOUT = "layout"    # the admin changed the MIG layout
    LOGOUT = "logout"    # the user's last session ended and nothing of theirs used the GPU
    USER = "user"        # the user released it (gpuguard release)
    ADMIN = "admin"      # an admin granted or revoked it (also Origin.ADMIN)
    COEXIST = "coexist"  # its GPU is Slurm's or Kubernetes' now ([coexist])
    MEMBERSHIP = "membership"  # the user is no longer in the GPU group (reload_effects)
    DRAIN = "drain"      # the admin drained its GPU (gpuguard drain): a warning, the grant stays
    SESSION = "session"  # granted at login or to a user with a session (Origin.SESSION)
    REQUEST = "request"  # granted on request with no session open (Origin.REQUEST)


@dataclass(frozen=True)
class Quota:
    gpus: int = 1
    gpu_memory: int | None = None       # bytes per GPU; None = unlimited
    max_time: float | None = None       # seconds a grant lasts; None = no limit
    idle_timeout: float | None = None   # seconds without a process before release
    sharing: bool = False               # may share GPUs with other sharing users
    priority: int = 0                   # the queue serves higher first (gpuguard.core.scheduler)
    share: float = 1.0                  # fair-share weight: recent usage counts divided by it
    reclaim_after: float | None = None  # seconds without a process before release, only while someone waits
    fleet_gpus: int | None = None     # GPUs on all servers of a fleet together (gpuguard.fleet); None = no limit
    max_sharers: int = 2                # sharing: at most this many users on one GPU (allocator)
    # MIG: `gpus` counts units, a whole GPU or a slice each. At most `slices` of them slices (None:
    # all may be), whole GPUs only when whole_gpus, slices of these profiles only, preferred in
    # this order (empty: any profile, the smallest first).
    slices: int | None = None
    whole_gpus: bool = True
    slice_profiles: tuple[str, ...] = ()
    # Fractions: part of one whole GPU's memory, shared with other fractions on it (gpuguard
    # request --memory). Each counts as one of `gpus`. fraction_memory: what a login, a plain
    # request, `gpuguard run` and a notebook ask for (None: whole GPUs); at most max_fractions
    # held at once (None: as many as `gpus`), each of min_fraction_memory..max_fraction_memory.
    fraction_memory: int | None = None
    max_fractions: int | None = None
    min_fraction_memory: int | None = None
    max_fraction_memory: int | None = None
    # Set only in the terms one ask for a fraction is served on (policy.fraction_terms), never in
    # quotas.toml: the bytes asked for, which the grant promises and the watcher holds it to.
    fraction: int | None = None


@dataclass(frozen=True)
class MigSlice:
    """Where a MIG slice sits, and the capability nodes the driver checks before it lets a
    process use it (/dev/nvidia-caps/nvidia-cap<N>, minors from /proc/driver/nvidia-caps/mig-minors)."""

    parent: int               # minor of the GPU it is cut from: its processes open /dev/nvidia<parent>
    gpu_instance: int         # GI id
    compute_instance: int     # CI id
    profile: str              # e.g. "1g.18gb"
    caps: tuple[int, int]     # nvidia-caps minors of gpu<parent>/gi<G>/access and .../ci<C>/access


@dataclass(frozen=True)
class Gpu:
    """A GPU as NVML shows it, or a MIG slice of one (NVML shows those as devices of their own)."""

    index: int               # NVML index (for display only); a slice has its parent's
    unit: int                # the identity gpuguard uses: a whole GPU's minor (/dev/nvidia<minor>), a slice's slice_unit
    uuid: str                # GPU-... or, for a slice, MIG-... (what CUDA_VISIBLE_DEVICES names)
    name: str
    pci_bus_id: str
    memory_total: int
    memory_used: int
    numa_node: int | None
    utilization: int | None  # percent, None when NVML cannot tell
    mig_mode: bool = False   # MIG enabled: handed out as its slices, never whole
    slice: MigSlice | None = None  # set for a MIG slice


@dataclass(frozen=True)
class GpuUse:
    """How busy one GPU is at a moment (NVML's device-wide numbers, all processes together)."""

    memory_used: int         # bytes
    memory_total: int        # bytes
    utilization: int | None  # percent of the last sample period with a kernel running; None: NVML cannot tell


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    unit: int                # the slice NVML places it in on a GPU in MIG mode, else its GPU's
    used_memory: int | None  # bytes; None = NVML does not know (never read as 0)


@dataclass(frozen=True)
class Grant:
    uid: int
    user: str
    unit: int                # a GPU's minor, or a slice's slice_unit
    granted_at: float
    expires_at: float | None
    last_active: float       # last time a process of the user was seen on it (idle release)
    shared: bool = False
    origin: Origin = Origin.SESSION
    uuid: str = ""           # the unit's UUID when granted: a slice re-created under the same ids has another
    memory: int | None = None  # a shared grant: the memory quota (bytes) promised to it on that GPU

    @property
    def fraction(self) -> int | None:
        """The memory promised to a shared grant, a fraction of its GPU that other fractions count
        on (None: the GPU is its holder's alone, or the promise is unknown)."""
        return self.memory if self.shared else None


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
    kind: str                 # an EventKind
    message: str
    unit: int | None = None
    pid: int | None = None
    command: str = ""
    rule: str = ""            # a Rule
    action: str = ""          # warn | term | kill | revoke | release ...
    numbers: dict[str, Any] = field(default_factory=dict)
    id: int | None = None
