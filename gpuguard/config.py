"""Load and validate /etc/gpuguard/gpuguard.toml and its quotas file.

Validation is strict and total: unknown keys, wrong types, bad units and absurd values are
all refused with one line naming the file, the key and the problem. A daemon keeps its
last good configuration when a reload fails, so refusing is always safe.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from gpuguard.core import mig_profiles
from gpuguard.core.compat import StrEnum, tomllib
from gpuguard.core.errors import UsageError
from gpuguard.core.model import MIG_PROFILE, Placement, Quota
from gpuguard.core.quantities import UnitError, format_duration, format_size, parse_duration, parse_size

DEFAULT_PATH = Path("/etc/gpuguard/gpuguard.toml")
# Accounts of the NVIDIA driver's own services, exempt by default where they exist:
# nvidia-persistenced runs as this user and keeps every GPU open.
DRIVER_ACCOUNTS = ("nvidia-persistenced",)
MAX_GPUS = 64  # per machine; more is a typo
MAX_GPU_MINOR = 253  # /dev/nvidia254 and 255 are nvidia-modeset and nvidiactl
MAX_EVENTS_PER_USER = 1_000_000  # more is a typo (whoami shows 20)
MIN_GPU_MEMORY = 256 << 20  # a memory quota under this cannot hold a CUDA context: a missing or wrong unit
MIN_LIMIT = 60.0  # max_time, idle_timeout under a minute on real GPUs: a missing or wrong unit

E = TypeVar("E", bound=StrEnum)


class ConfigError(UsageError):
    """One line: `file: key: problem`."""


class AccessMode(StrEnum):
    GATE = "gate"  # the BPF device program at the cgroup v2 root, plus the node ACLs
    ACL = "acl"    # the node ACLs only, by explicit choice (no BPF)


class GpuBackend(StrEnum):
    NVML = "nvml"
    SIMULATED = "simulated"  # the fake NVML library: the demo, the tests, `gpuguard replay`


@dataclass(frozen=True)
class AccessConfig:
    group: str = "gpugroup"
    exempt_users: tuple[str, ...] = DRIVER_ACCOUNTS
    exempt_groups: tuple[str, ...] = ()
    mode: AccessMode = AccessMode.GATE


@dataclass(frozen=True)
class SessionsConfig:
    """Which PAM sessions take GPUs (policy.login_takes_gpus); the others only see what is held."""
    grant: str = "interactive"          # "interactive": a terminal, or one of `services`; "all"
    services: tuple[str, ...] = ()      # PAM services that take GPUs without a terminal (jupyterhub)


@dataclass(frozen=True)
class WatcherConfig:
    interval: float = 2.0
    grace: float = 30.0      # over quota this long before the first SIGTERM
    kill_wait: float = 10.0  # SIGTERM this long before SIGKILL


@dataclass(frozen=True)
class EventsConfig:
    """How much event history the store keeps: what `gpuguard whoami` shows and admins look back on.
    Both bounds hold, so neither a long uptime nor a user looping request/release grows it without end."""

    max_age: float | None = 90 * 86400.0  # seconds; None: no age limit
    per_user: int = 1000                  # newest events kept per user (and for system events); 0, which
                                          # no config file may set: none (a replay's store)


@dataclass(frozen=True)
class SchedulerConfig:
    """The queue for GPUs (gpuguard.core.scheduler)."""

    half_life: float = 7 * 86400.0  # recent usage (fair share) halves in this time
    reserve_after: float = 300.0    # a waiter this long in the queue has free GPUs held for it (no backfill past it)
    soft_max_time: bool = False     # true: a grant past max_time is taken only when someone waits
    max_wait_boost: float = 86400.0  # a waiter this long in the queue goes ahead of younger ones, whatever its usage
    fraction_placement: Placement = Placement.FGD  # how a fraction's GPU is chosen (allocator.place_fraction)


@dataclass(frozen=True)
class PathsConfig:
    state_dir: Path = Path("/var/lib/gpuguard")
    socket: Path = Path("/run/gpuguard/gpuguard.sock")
    device_dir: Path = Path("/dev")
    quotas: Path = Path("/etc/gpuguard/quotas.toml")


@dataclass(frozen=True)
class SimulatedConfig:
    count: int = 4
    memory: int = 80 << 30
    name: str = "NVIDIA H100 80GB HBM3"
    nvlink_groups: tuple[tuple[int, ...], ...] | None = None  # None: consecutive pairs
    pcie_switches: tuple[tuple[int, ...], ...] | None = None  # None: groups of four
    numa_nodes: tuple[tuple[int, ...], ...] | None = None     # None: two halves
    # GPUs in MIG mode and the profiles of their slices, by minor (no slices: MIG mode, none cut yet);
    # the layout the simulated GPUs start with (`gpuguard sim mig` changes it)
    mig: tuple[tuple[int, tuple[str, ...]], ...] = ()

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """The declared grouping of GPU minors, or the default shape of a typical 8-GPU box."""
        declared: tuple[tuple[int, ...], ...] | None = getattr(self, kind)
        if declared is not None:
            return declared
        size = {"nvlink_groups": 2, "pcie_switches": 4, "numa_nodes": max(1, (self.count + 1) // 2)}[kind]
        return tuple(tuple(range(i, min(i + size, self.count))) for i in range(0, self.count, size))


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics and the files other tools read; every exporter is off until configured."""

    listen: tuple[str, int] | None = None  # (address, port) of the /metrics endpoint
    textfile: Path | None = None           # node_exporter textfile collector file (*.prom)
    dcgm_job_mapping_dir: Path | None = None  # dcgm-exporter's HPC job mapping directory


@dataclass(frozen=True)
class NotifyConfig:
    """Notices for people without a terminal (VS Code, Jupyter): every line the daemon writes to a
    user's terminals also goes to their webhook and e-mail address, when configured."""

    webhook: str | None = None             # URL for a JSON POST; "{user}" becomes the user's name
    mail: str | None = None                # e-mail address; "{user}" becomes the user's name
    addresses: Path | None = None          # TOML file of [users.NAME] webhook/mail, over the templates
    sendmail: Path = Path("/usr/sbin/sendmail")  # the MTA's sendmail interface (Debian: any MTA provides it)
    per_user_hour: int = 20                # notices per user and hour; more are dropped (and counted)
    users: dict[str, dict[str, str]] = field(default_factory=dict)  # read from `addresses`

    @property
    def enabled(self) -> bool:
        return bool(self.webhook or self.mail or self.users)


@dataclass(frozen=True)
class WebConfig:
    """`gpuguard web`, the read-only web view (gpuguard.web): off until `listen` is set."""

    listen: tuple[str, int] | None = None  # (address, port) it serves on
    # The account `gpuguard web` runs as: the daemon lets it read every user's records (whoami,
    # report, events), as root may, and nothing more; it changes nothing.
    user: str = "gpuguard-web"
    show_users: bool = True                # false: other users' names are hidden from non-admins
    admin_group: str | None = None         # its members see every user's page and usage
    pam_service: str = "gpuguard-web"      # the PAM service of its login (/etc/pam.d/gpuguard-web)
    key_file: Path = Path("/var/lib/gpuguard-web/session.key")  # signs the forms' CSRF tokens; made at start
    session_time: float = 8 * 3600.0       # a login lasts this long
    secure_cookies: bool = True            # cookies only over HTTPS (browsers allow http://localhost too)
    # Reverse proxies whose X-Forwarded-For names the client (the login delay's key, PAM_RHOST);
    # from anyone else the header is ignored.
    trusted_proxies: tuple[IpNetwork, ...] = ()
    contact: str | None = None              # whom a non-member should ask to join the GPU group
    tls_cert: Path | None = None            # HTTPS with this certificate chain (PEM) and tls_key; both or neither
    tls_key: Path | None = None


@dataclass(frozen=True)
class CoexistConfig:
    """GPUs another system owns on this machine (gpuguard.core.coexist): left out of the gate, the ACLs and allocation."""

    slurm: str | tuple[int, ...] | None = None  # "auto" (gres.conf), "off", or Slurm's GPU minors; None: not set
    gres_conf: Path = Path("/etc/slurm/gres.conf")
    slurm_node: str | None = None               # this host's Slurm NodeName; None: the short host name
    k8s_gpus: tuple[int, ...] = ()              # minors the Kubernetes device plugin hands to containers


@dataclass(frozen=True)
class GpuConfig:
    backend: GpuBackend = GpuBackend.NVML
    simulated: SimulatedConfig = field(default_factory=SimulatedConfig)


class OfflinePolicy(StrEnum):
    """What a node of a fleet grants while the shared database cannot be reached (gpuguard.fleet)."""

    LOCAL = "local"    # the local quota alone: the fleet quota may be exceeded until the database is back
    BUDGET = "budget"  # also the fleet quota less what the user held elsewhere when last seen


@dataclass(frozen=True)
class FleetConfig:
    """Several servers sharing one PostgreSQL (gpuguard.fleet); read at start only."""

    database: str                   # a libpq connection string or URI (host=a,b target_session_attrs=read-write)
    node: str                       # this server's name in the fleet (unique)
    rack: str = ""
    ssh: str = ""                   # what `gpuguard where` puts after ssh ('' : the node name)
    heartbeat: float = 10.0         # seconds between heartbeats
    lease: float = 30.0             # silent this long: the node shows as lost
    grace: float = 60.0             # lost this long more: its grants stop counting against fleet quotas
    timeout: float = 0.5            # the longest a login waits on the database
    offline_policy: OfflinePolicy = OfflinePolicy.LOCAL
    # storage paths and the nodes or racks that hold them (`gpuguard where --data PATH`)
    data: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class QuotaOverrides:
    """Per-user and per-group quota fields from quotas.toml; only the keys written there."""

    users: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    renamed: tuple[str, ...] = ()  # old names read in the file (RENAMED), for a warning


# The [defaults] a config starts from. Reclaim on demand is on: a GPU with none of its user's
# processes for 10 minutes goes to someone waiting (never while nobody waits, and never while a
# process, an open notebook kernel included, is on it), so a finished or forgotten grant does not
# hold the queue; everything else is Quota's own default (no idle release, no time limit). 10
# rather than 30 minutes: on the Adobe notebook replay it drops 9 jobs instead of 23 (47 GPUs) and
# 24 instead of 39 (40 GPUs) whose users logged out while waiting (docs/scheduling.md, Why the
# defaults are what they are).
DEFAULT_QUOTA = Quota(reclaim_after=600.0)


@dataclass(frozen=True)
class Config:
    source: Path | None = None
    access: AccessConfig = field(default_factory=AccessConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    defaults: Quota = DEFAULT_QUOTA
    watcher: WatcherConfig = field(default_factory=WatcherConfig)
    events: EventsConfig = field(default_factory=EventsConfig)

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    web: WebConfig = field(default_factory=WebConfig)
    coexist: CoexistConfig = field(default_factory=CoexistConfig)
    quotas: QuotaOverrides = field(default_factory=QuotaOverrides)
    fleet: FleetConfig | None = None  # None: a single server
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    renamed: tuple[str, ...] = ()  # old names read in the files (RENAMED), for a warning


# --- value parsers: each takes the raw TOML value and returns the typed one or raises ValueError

def _string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


# The longest text a node may write to the fleet database (its rack, its ssh line): the schema's
# TEXT_MAX, which a released migration copies (gpuguard.fleet.schema); longer, every heartbeat fails.
FLEET_TEXT_MAX = 255


def _fleet_text(value: Any) -> str:
    text = _string(value)
    if len(text) > FLEET_TEXT_MAX:
        raise ValueError(f"at most {FLEET_TEXT_MAX} characters (the fleet database keeps no longer), got {len(text)}")
    return text


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"expected a list of names, got {value!r}")
    return tuple(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {value!r}")
    return value


def _count(low: int, high: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        number = _integer(value)
        if not low <= number <= high:
            raise ValueError(f"must be between {low} and {high}, got {number}")
        return number
    return parse


def _positive_size(value: Any) -> int:
    size = parse_size(value)
    if not size:
        raise ValueError(f"expected a positive size, got {value!r}")
    return size


def _gpu_memory(value: Any) -> int | None:
    size = parse_size(value)
    if size == 0:
        raise ValueError(f"{value!r} would leave no memory at all; write unlimited for no limit")
    if size is not None and size < MIN_GPU_MEMORY:
        number = value.strip().rstrip("BbKkMmGgTtIi ") if isinstance(value, str) else value
        raise ValueError(f"{value!r} is under {format_size(MIN_GPU_MEMORY)}, too little for any GPU job; "
                         f"did you mean {number}GiB?")
    return size


def _limit(what: str) -> Callable[[Any], float | None]:
    """A quota's time limit: a duration or none, never zero (it would act at once on every grant)."""
    def parse(value: Any) -> float | None:
        # a bare 0 too: "did you mean 0h?" would only lead to this refusal
        if _bare_zero(value) or (seconds := parse_duration(value)) == 0:
            raise ValueError(f"{value!r} would {what} at once; write none for no limit")
        return seconds
    return parse


def _bare_zero(value: Any) -> bool:
    try:
        return parse_duration(value, bare_unit="s") == 0
    except UnitError:
        return False


def _check_floors(where: str, fields: dict[str, Any]) -> None:
    """Quota limits too short for real GPUs, where a test or demo on simulated GPUs may want them:
    a minute for max_time and idle_timeout (`30s` was most likely `30m`). reclaim_after acts only
    while someone waits, so a few seconds is a policy (bench/scheduling-exclusive.toml), not a typo."""
    for key in ("max_time", "idle_timeout"):
        seconds = fields.get(key)
        if seconds is not None and seconds < MIN_LIMIT:
            raise ConfigError(f"{where}.{key}: {format_duration(seconds)} is under a minute; "
                              f"did you mean {format_duration(seconds * 60)}?")


def _positive_duration(minimum: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        seconds = parse_duration(value)
        if seconds is None or seconds < minimum:
            raise ValueError(f"must be a duration of at least {minimum:g}s, got {value!r}")
        return seconds
    return parse


def _weight(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"expected a positive number, got {value!r}")
    return float(value)


def _path(value: Any) -> Path:
    return Path(_string(value))


def _absolute_path(value: Any) -> Path:
    path = _path(value)
    if not path.is_absolute():
        raise ValueError(f"expected an absolute path, got {value!r}")
    return path


def _textfile(value: Any) -> Path:
    path = _absolute_path(value)
    if path.suffix != ".prom":  # node_exporter's textfile collector reads *.prom files only
        raise ValueError(f"must end in .prom (node_exporter reads only those), got {value!r}")
    return path


def _listen(value: Any) -> tuple[str, int]:
    """`127.0.0.1:9447`, `[::1]:9447` or `0.0.0.0:9447`: an IP address (or localhost) and a port."""
    host, colon, port = _string(value).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected ADDRESS:PORT like 127.0.0.1:9447, got {value!r}")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"not an IP address: {host!r} (write e.g. 127.0.0.1:9447)") from None
    return host, int(port)


parse_listen = _listen  # `gpuguard web --listen` takes the same form
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _networks(value: Any) -> tuple[IpNetwork, ...]:
    """A list of addresses or networks: `["127.0.0.1", "10.1.0.0/16", "::1"]`."""
    if not isinstance(value, list):
        raise ValueError(f"expected a list of addresses or networks, got {value!r}")
    try:
        return tuple(ipaddress.ip_network(_string(v)) for v in value)
    except ValueError as exc:
        raise ValueError(f"expected addresses or networks like 10.1.0.0/16: {exc}") from None


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {value!r}")
        return str(value)
    return parse


def _member(kind: type[E]) -> Callable[[Any], E]:
    """A value of a StrEnum, by its string."""
    choose = _choice(*kind)

    def parse(value: Any) -> E:
        return kind(choose(value))
    return parse


def _groups(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list) or not all(
            isinstance(g, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in g) for g in value):
        raise ValueError(f"expected a list of lists of GPU minors, got {value!r}")
    return tuple(tuple(g) for g in value)


def _mig(value: Any) -> tuple[tuple[int, tuple[str, ...]], ...]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and k.isdigit() and isinstance(v, list) and all(isinstance(p, str) for p in v)
            for k, v in value.items()):
        raise ValueError(f'expected GPU minors and their MIG profiles, like {{ "0" = ["1g.10gb", "3g.40gb"] }}, '
                         f"got {value!r}")
    return tuple(sorted((int(minor), tuple(profiles)) for minor, profiles in value.items()))


def _data_map(value: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`[fleet.data]`: `"/data/imagenet" = ["gpu1", "rack-b"]`, absolute paths to node or rack names."""
    if not isinstance(value, dict):
        raise ValueError(f'expected paths and the nodes or racks holding them, like {{ "/data" = ["gpu1"] }}, got {value!r}')
    for path, names in value.items():
        if not path.startswith("/"):
            raise ValueError(f"expected an absolute path, got {path!r}")
        _names(names)
    return tuple(sorted((path.rstrip("/") or "/", tuple(names)) for path, names in value.items()))


def _fleet_limit(value: Any) -> int | None:
    """GPUs on all servers of a fleet together: a count, or "none" (no fleet limit)."""
    if value == "none":
        return None
    return _count(0, 100_000)(value)


def _template(kind: str, check: Callable[[str], bool]) -> Callable[[Any], str]:
    """A webhook URL or an e-mail address, where {user} stands for the user's name."""
    def parse(value: Any) -> str:
        text = _string(value)
        try:
            example = text.format(user="alice")
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"expected a {kind} where only {{user}} is replaced, got {value!r}") from None
        if not check(example) or any(ch.isspace() or ord(ch) < 32 for ch in example):
            raise ValueError(f"not a {kind}: {value!r}")
        return text
    return parse


_WEBHOOK = _template("http:// or https:// URL", lambda url: url.startswith(("http://", "https://")))
_MAIL = _template("mail address", lambda address: address.count("@") == 1 and not address.startswith(("-", "@")))


def _minors(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(m, int) and not isinstance(m, bool) for m in value):
        raise ValueError(f"expected a list of GPU minors, got {value!r}")
    if bad := [m for m in value if not 0 <= m <= MAX_GPU_MINOR]:
        raise ValueError(f"GPU minors are 0 to {MAX_GPU_MINOR}, got {bad[0]}")
    if len(set(value)) != len(value):
        raise ValueError(f"a GPU is listed twice in {value!r}")
    return tuple(sorted(value))


def _slurm(value: Any) -> str | tuple[int, ...]:
    """"auto" (read gres.conf), "off" (Slurm owns no GPU here), or the minors Slurm owns."""
    if isinstance(value, list):
        return _minors(value)
    return _choice("auto", "off")(value)


def _count_or_any(value: Any) -> int | None:
    """How many of a user's units may be MIG slices, or fractions: a count, or "any" (no limit of its own)."""
    if value == "any":
        return None
    return _count(0, MAX_GPUS)(value)


def _profiles(value: Any) -> tuple[str, ...]:
    names = _names(value)
    if bad := [name for name in names if not MIG_PROFILE.fullmatch(name)]:
        raise ValueError(f"expected MIG profiles such as 1g.18gb, got {bad[0]!r}")
    return names


QUOTA_KEYS: dict[str, Callable[[Any], Any]] = {
    "gpus": _count(0, MAX_GPUS),
    "gpu_memory": _gpu_memory,
    "max_time": _limit("end every grant"),
    "idle_timeout": _limit("release every grant"),
    "sharing": _bool,
    "priority": _integer,
    "share": _weight,
    "reclaim_after": _limit("take back every grant someone waits for"),
    "fleet_gpus": _fleet_limit,
    "max_sharers": _count(1, MAX_GPUS),
    "slices": _count_or_any,
    "whole_gpus": _bool,
    "slice_profiles": _profiles,
    "fraction_memory": _gpu_memory,
    "max_fractions": _count_or_any,
    "min_fraction_memory": _gpu_memory,
    "max_fraction_memory": _gpu_memory,
}

SCHEMA: dict[str, dict[str, Callable[[Any], Any]]] = {
    "access": {"group": _string, "exempt_users": _names, "exempt_groups": _names,
               "mode": _member(AccessMode)},
    "sessions": {"grant": _choice("interactive", "all"), "services": _names},
    "defaults": QUOTA_KEYS,
    "watcher": {"interval": _positive_duration(0.1), "grace": _positive_duration(0),
                "kill_wait": _positive_duration(0)},
    "events": {"max_age": parse_duration, "per_user": _count(1, MAX_EVENTS_PER_USER)},

    "scheduler": {"half_life": _positive_duration(1), "reserve_after": _positive_duration(0),
                  "soft_max_time": _bool, "max_wait_boost": _positive_duration(0),
                  "fraction_placement": _member(Placement)},
    "paths": {"state_dir": _path, "socket": _path, "device_dir": _path, "quotas": _path},
    "gpu": {"backend": _member(GpuBackend), "simulated": dict},
    "metrics": {"listen": _listen, "textfile": _textfile, "dcgm_job_mapping_dir": _absolute_path},
    "notify": {"webhook": _WEBHOOK, "mail": _MAIL, "addresses": _absolute_path, "sendmail": _absolute_path,
               "per_user_hour": _count(1, 3600)},
    "web": {"listen": _listen, "user": _string, "show_users": _bool, "admin_group": _string,
            "pam_service": _string, "key_file": _absolute_path, "session_time": _positive_duration(60),
            "secure_cookies": _bool, "trusted_proxies": _networks,
            "contact": _string, "tls_cert": _absolute_path, "tls_key": _absolute_path},
    "coexist": {"slurm": _slurm, "gres_conf": _absolute_path, "slurm_node": _string, "k8s_gpus": _minors},
    "fleet": {"database": _string, "node": _string, "rack": _fleet_text, "ssh": _fleet_text,
                "heartbeat": _positive_duration(1), "lease": _positive_duration(1), "grace": _positive_duration(0),
                "timeout": _positive_duration(0.05), "offline_policy": _member(OfflinePolicy), "data": _data_map},
    "gpu.simulated": {"count": _count(1, MAX_GPUS), "memory": _positive_size, "name": _string,
                      "nvlink_groups": _groups, "pcie_switches": _groups, "numa_nodes": _groups, "mig": _mig},
}


# Sections and keys renamed, each read under its old name for one release with a warning
# (config check prints it, the daemon logs it at start): old name -> new name.
RENAMED = {"cluster": "fleet", "cluster_gpus": "fleet_gpus"}


def _new_names(source: Path, where: str, table: dict[str, Any], renamed: list[str]) -> dict[str, Any]:
    """The table with its old names (RENAMED) under their new ones, each noted in `renamed`;
    both names at once is refused."""
    for old in RENAMED.keys() & table.keys():
        new = RENAMED[old]
        if new in table:
            raise ConfigError(f"{source}: {where}{old} and {where}{new}: the same setting twice ({old} is its old name)")
        renamed.append(f"{source}: {where}{old} is now {where}{new} (the old name is read until the next release)")
        table = {(new if key == old else key): value for key, value in table.items()}
    return table


def _parse_table(source: Path, section: str, table: Any, keys: dict[str, Callable[[Any], Any]],
                 renamed: list[str] | None = None) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {section}: expected a table, got {table!r}")
    if renamed is not None:
        table = _new_names(source, f"{section}.", table, renamed)
    parsed: dict[str, Any] = {}
    for key, value in table.items():
        if key not in keys:
            raise ConfigError(f"{source}: {section}.{key}: unknown key (known: {', '.join(keys)})")
        try:
            parsed[key] = keys[key](value)
        except (ValueError, UnitError) as exc:
            raise ConfigError(f"{source}: {section}.{key}: {exc}") from None
    return parsed


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            parsed: dict[str, Any] = tomllib.load(handle)
            return parsed
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def _check_topology(source: Path, sim: SimulatedConfig) -> None:
    for kind in ("nvlink_groups", "pcie_switches", "numa_nodes"):
        seen: set[int] = set()
        for group in sim.groups(kind):
            for minor in group:
                if not 0 <= minor < sim.count:
                    raise ConfigError(f"{source}: gpu.simulated.{kind}: GPU {minor} does not exist (count = {sim.count})")
                if minor in seen:
                    raise ConfigError(f"{source}: gpu.simulated.{kind}: GPU {minor} is listed twice")
                seen.add(minor)


def _check_mig(source: Path, sim: SimulatedConfig) -> None:
    for minor, profiles in sim.mig:
        if not 0 <= minor < sim.count:
            raise ConfigError(f"{source}: gpu.simulated.mig: GPU {minor} does not exist (count = {sim.count})")
        try:
            mig_profiles.place(sim.name, profiles)
        except ValueError as exc:
            raise ConfigError(f"{source}: gpu.simulated.mig.{minor}: {exc}") from None


def _fleet(source: Path, section: dict[str, Any] | None) -> FleetConfig | None:
    if section is None:
        return None
    if "database" not in section:
        raise ConfigError(f"{source}: fleet.database: missing (a PostgreSQL connection string)")
    fleet = FleetConfig(**{"node": socket.gethostname().split(".")[0], **section})
    if fleet.lease < 2 * fleet.heartbeat:
        raise ConfigError(f"{source}: fleet.lease: must be at least twice fleet.heartbeat "
                          f"({fleet.heartbeat:g}s), got {fleet.lease:g}s")
    return fleet


def _coexist(source: Path, section: dict[str, Any]) -> CoexistConfig:
    coexist = CoexistConfig(**section)
    if isinstance(coexist.slurm, tuple) and (both := sorted(set(coexist.slurm) & set(coexist.k8s_gpus))):
        raise ConfigError(f"{source}: coexist.k8s_gpus: GPU {both[0]} is also in coexist.slurm: one system owns a GPU")
    return coexist


def load_quotas(path: Path, floors: bool = True) -> QuotaOverrides:
    """Read quotas.toml: `[users.NAME]` and `[groups.NAME]` tables of quota keys. Missing file: none.
    floors: refuse time limits under a minute (real GPUs; the simulated ones allow them, for tests)."""
    if not path.exists():
        return QuotaOverrides()
    data = _read_toml(path)
    tables: dict[str, dict[str, dict[str, Any]]] = {"users": {}, "groups": {}}
    renamed: list[str] = []
    for kind, entries in data.items():
        if kind not in tables:
            raise ConfigError(f"{path}: {kind}: unknown table (known: users, groups)")
        if not isinstance(entries, dict):
            raise ConfigError(f"{path}: {kind}: expected tables like [{kind}.NAME]")
        for name, table in entries.items():
            tables[kind][name] = _parse_table(path, f"{kind}.{name}", table, QUOTA_KEYS, renamed)
            if floors:
                _check_floors(f"{path}: {kind}.{name}", tables[kind][name])
    return QuotaOverrides(users=tables["users"], groups=tables["groups"], renamed=tuple(renamed))


def load_addresses(path: Path) -> dict[str, dict[str, str]]:
    """The per-user notice addresses: `[users.NAME]` tables of `webhook` and `mail`."""
    data = _read_toml(path)
    if set(data) - {"users"} or not isinstance(data.get("users", {}), dict):
        raise ConfigError(f"{path}: expected only tables like [users.NAME]")
    return {name: _parse_table(path, f"users.{name}", table, {"webhook": _WEBHOOK, "mail": _MAIL})
            for name, table in data.get("users", {}).items()}


def load(path: Path | str | None = None) -> Config:
    """Load and validate a config file (and the quotas file it names). Raises ConfigError."""
    source = Path(path) if path else default_path()
    renamed: list[str] = []
    data = _new_names(source, "", _read_toml(source), renamed)
    sections: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        if section not in SCHEMA:
            raise ConfigError(f"{source}: {section}: unknown section (known: {', '.join(s for s in SCHEMA if '.' not in s)})")
        sections[section] = _parse_table(source, section, table, SCHEMA[section], renamed)
    gpu_section = sections.get("gpu", {})
    simulated = SimulatedConfig(**_parse_table(source, "gpu.simulated", gpu_section.pop("simulated", {}),
                                               SCHEMA["gpu.simulated"]))
    _check_topology(source, simulated)
    _check_mig(source, simulated)

    floors = gpu_section.get("backend", GpuBackend.NVML) == GpuBackend.NVML
    if floors:
        _check_floors(f"{source}: defaults", sections.get("defaults", {}))
    paths_section = sections.get("paths", {})
    # The quotas file sits next to the config file unless the admin names another one.
    paths = replace(PathsConfig(**paths_section),
                    quotas=source.parent / paths_section.get("quotas", "quotas.toml"))

    config = Config(
        source=source,
        access=AccessConfig(**sections.get("access", {})),
        sessions=SessionsConfig(**sections.get("sessions", {})),
        defaults=replace(DEFAULT_QUOTA, **sections.get("defaults", {})),
        watcher=WatcherConfig(**sections.get("watcher", {})),
        events=EventsConfig(**sections.get("events", {})),

        scheduler=SchedulerConfig(**sections.get("scheduler", {})),
        paths=paths,
        gpu=GpuConfig(simulated=simulated, **gpu_section),
        metrics=MetricsConfig(**sections.get("metrics", {})),
        web=WebConfig(**sections.get("web", {})),
        coexist=_coexist(source, sections.get("coexist", {})),
        quotas=(quotas := load_quotas(paths.quotas, floors)),
        notify=_notify(sections.get("notify", {})),
        fleet=_fleet(source, sections.get("fleet")),
        renamed=(*renamed, *quotas.renamed),
    )
    if config.gpu.backend == GpuBackend.NVML and config.watcher.interval < 1.0:
        # NVML process queries serialize on the driver lock; faster polling slows every CUDA call.
        raise ConfigError(f"{source}: watcher.interval: must be at least 1s with the nvml backend")
    return config


def _notify(section: dict[str, Any]) -> NotifyConfig:
    addresses = section.get("addresses")
    return NotifyConfig(**section, users=load_addresses(addresses) if addresses else {})


def default_path() -> Path:
    return Path(os.environ.get("GPUGUARD_CONFIG") or DEFAULT_PATH)
