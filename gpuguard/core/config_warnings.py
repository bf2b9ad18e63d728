"""What `gpuguard config check` warns about: a configuration that loads but will not do what its
author likely meant. Warnings, not errors: accounts are often created after the configuration
(or come late from LDAP), and the daemon runs fine meanwhile. Pure: lookups are passed in.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from gpuguard.config import DRIVER_ACCOUNTS, Config, FleetConfig, MetricsConfig, WebConfig
from gpuguard.core import policy
from gpuguard.core.model import Quota
from gpuguard.core.quantities import format_size

# Where etc/gpuguard.service (ProtectSystem=strict) lets the daemon write files: its
# RuntimeDirectory= and StateDirectory=.
UNIT_WRITABLE = (Path("/run/gpuguard"), Path("/var/lib/gpuguard"))


def warnings(config: Config, user_exists: Callable[[str], bool], group_exists: Callable[[str], bool],
             file_exists: Callable[[Path], bool] = Path.exists) -> list[str]:
    """One line per finding, naming the key."""
    access = config.access
    found = []
    if not group_exists(access.group):
        found.append(f"access.group: no group named {access.group} on this host (yet): nobody gets GPUs until it exists")
    found += [f"access.exempt_users: no user named {name} on this host (yet)"
              for name in access.exempt_users if name not in DRIVER_ACCOUNTS and not user_exists(name)]
    found += [f"access.exempt_groups: no group named {name} on this host (yet)"
              for name in access.exempt_groups if not group_exists(name)]
    if not file_exists(config.paths.quotas):
        found.append(f"paths.quotas: {config.paths.quotas} does not exist: every member gets the [defaults]")
    found += [f"{config.paths.quotas}: no user named {name} on this host (yet)"
              for name in config.quotas.users if not user_exists(name)]
    found += [f"{config.paths.quotas}: no group named {name} on this host (yet)"
              for name in config.quotas.groups if not group_exists(name)]
    memory = config.defaults.gpu_memory
    if config.defaults.sharing and memory is None:
        found.append("defaults.sharing: has no effect without a gpu_memory limit (nobody shares a GPU)")
    for kind, tables in (("users", config.quotas.users), ("groups", config.quotas.groups)):
        found += [f"{config.paths.quotas}: {kind}.{name}.sharing: has no effect without a gpu_memory limit"
                  for name, table in tables.items()
                  if table.get("sharing") and table.get("gpu_memory", memory) is None]
        found += [line for name, table in tables.items()
                  for line in _fractions(f"{config.paths.quotas}: {kind}.{name}", replace(config.defaults, **table))]
    found += _fractions("defaults", config.defaults)
    return [*config.renamed, *found, *_under_the_unit(config.metrics), *_fleet(config.fleet), *_web(config.web)]


def _fractions(where: str, quota: Quota) -> list[str]:
    """A fraction_memory that the same quota refuses: every login and plain request of its users
    would ask for it and be refused (their logins go on, without a GPU)."""
    if (memory := quota.fraction_memory) is None:
        return []
    low, high = policy.fraction_bounds(quota, memory)  # (the GPUs' own memory is not known here)
    if policy.fraction_limit(quota) == 0:
        return [f"{where}.fraction_memory: asks for fractions the same quota allows none of (max_fractions, "
                "gpus or whole_gpus): their logins get no GPU"]
    if not low <= memory <= high:
        return [f"{where}.fraction_memory: {format_size(memory)} is outside {format_size(low)} to "
                f"{format_size(high)} (min_fraction_memory, max_fraction_memory, gpu_memory): their logins get no GPU"]
    return []


def _web(web: WebConfig) -> list[str]:
    """A web view others reach over plain HTTP: no login works (browsers keep no Secure cookie
    there), or, without secure cookies, passwords cross the network in the clear."""
    if (web.tls_cert is None) != (web.tls_key is None):
        return ["web.tls_cert, web.tls_key: set both or neither (gpuguard web will not start with one)"]
    if web.listen is None or web.tls_cert is not None or _local(web.listen[0]):
        return []
    where = f"web.listen: {web.listen[0]} is reachable from other hosts over plain HTTP (no tls_cert)"
    if web.secure_cookies:
        return [f"{where}: browsers keep no Secure cookie there, so nobody can log in from another host; set "
                "tls_cert and tls_key, or listen on 127.0.0.1 behind an SSH tunnel or a TLS proxy (trusted_proxies)"]
    return [f"{where} and secure_cookies = false: passwords and logins cross the network in the clear"]


def _fleet(fleet: FleetConfig | None) -> list[str]:
    """The fleet database's connection string: a password in a file users may read, and hosts the
    shipped unit's IPAddressAllow=localhost does not let the daemon reach."""
    if fleet is None:
        return []
    found = []
    database = fleet.database
    uri = re.match(r"postgres(?:ql)?://", database)
    if re.search(r"(?:^|\s)password\s*=", database) or (uri and ":" in urlsplit(database).netloc.rpartition("@")[0]):
        found.append("fleet.database: holds a password, and gpuguard.toml is readable by users: use passfile= "
                     "(a root-only file in .pgpass format) instead")
    if uri:  # postgresql://user@host1:5432,[::1]:5433/db
        hosts = [_uri_host(part) for part in urlsplit(database).netloc.rpartition("@")[2].split(",") if part]
    else:
        hosts = [h for m in re.finditer(r"(?:^|\s)(?:host|hostaddr)\s*=\s*(\S+)", database) for h in m[1].split(",")]
    remote = sorted({host for host in hosts if not _local(host)})
    if remote:
        found.append(f"fleet.database: {', '.join(remote)} is not this host, and the systemd unit lets the daemon "
                     "reach only localhost (IPAddressAllow=localhost): open it with a drop-in "
                     "(docs/several-servers.md, Setting it up)")
    return found


def _uri_host(part: str) -> str:
    """The host of a URI's `host[:port]` or `[v6]:port`."""
    if part.startswith("["):
        return part[1:part.find("]")]
    return part.partition(":")[0]


def _local(host: str) -> bool:
    """A Unix socket directory, localhost, or a loopback address."""
    if not host or host.startswith("/") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _under_the_unit(metrics: MetricsConfig) -> list[str]:
    """Metrics settings the shipped systemd unit's sandbox blocks until a drop-in opens it."""
    found = []
    if metrics.listen is not None:
        host, port = metrics.listen
        if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
            found.append(f"metrics.listen: {host}:{port} is not loopback, and the systemd unit lets only localhost "
                         "connect (IPAddressAllow=localhost): open it with a drop-in (docs/admin.md, The systemd unit)")
    for key, directory in (("textfile", metrics.textfile and metrics.textfile.parent),
                           ("dcgm_job_mapping_dir", metrics.dcgm_job_mapping_dir)):
        if directory is not None and not any(directory.is_relative_to(top) for top in UNIT_WRITABLE):
            found.append(f"metrics.{key}: the systemd unit makes {directory} read-only (ProtectSystem=strict): "
                         f"add ReadWritePaths={directory} with a drop-in (docs/admin.md, The systemd unit)")
    return found
