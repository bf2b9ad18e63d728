"""Pure: the fleet as `status --fleet` shows it, and which server `gpuguard where` recommends.

Input: the rows of fleetdb.VIEW (one per node and GPU). A node silent past its lease is lost:
shown, never recommended. Locality of data: `[fleet.data]` maps storage paths to the nodes
or racks holding them; the longest path that contains the one asked for decides, and a node
is near when it is one of those nodes (0), in the rack of one of them or in a rack named
there (1), or elsewhere (2).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuguard.core.escape import printable

LOCALITY = ("same node", "same rack", "another rack")


@dataclass(frozen=True)
class GpuView:
    minor: int
    uuid: str
    name: str
    owner: str
    holders: tuple[str, ...]


@dataclass(frozen=True)
class NodeView:
    name: str
    rack: str
    ssh: str
    version: str
    silent_for: float        # seconds since its last heartbeat (database clock); inf: its time is not a number
    lost: bool               # silent longer than its lease
    counted: bool            # its grants still count against fleet quotas (lost for less than grace)
    queued: int
    queued_gpus: int
    gpus: tuple[GpuView, ...] = field(default=())

    @property
    def free(self) -> int:
        return sum(1 for gpu in self.gpus if gpu.owner == "gpuguard" and not gpu.holders)

    @property
    def open(self) -> int:
        """Free GPUs a newcomer could be given now: those the node's queue waits for go to it first."""
        return max(0, self.free - self.queued_gpus)


@dataclass(frozen=True)
class Choice:
    node: NodeView
    may_take: int              # GPUs the user may take there now: free ones the queue does not wait for,
                               # within their quota on one server and their fleet quota
    locality: int | None       # index into LOCALITY, None when no data path was given

    @property
    def ssh(self) -> str:
        return f"ssh {self.node.ssh or self.node.name}"


def nodes(rows: Iterable[Mapping[str, Any]]) -> list[NodeView]:
    """fleetdb.VIEW rows grouped by node. What a database holds is data, never trusted to be
    sane: every text is made printable (no newline to forge a table's line, no escape sequence
    to recolour or move a terminal), and a node whose times are not numbers (NaN, an infinity:
    written before the schema's CHECKs, or by hand) is lost and its grants do not count."""
    found: dict[str, tuple[Mapping[str, Any], list[GpuView]]] = {}
    for row in rows:
        _, gpus = found.setdefault(row["node"], (row, []))
        if row["minor"] is not None:
            gpus.append(GpuView(row["minor"], printable(row["uuid"]), printable(row["gpu_name"]),
                                printable(row["owner"]), tuple(map(printable, row["holders"]))))
    views = []
    for name, (row, gpus) in found.items():
        silent, lease, grace = float(row["now"]) - row["last_seen"], float(row["lease"]), float(row["grace"])
        sane = all(map(math.isfinite, (silent, lease, grace)))  # before max(): max(0.0, nan) is 0.0
        silent = max(0.0, silent)
        views.append(NodeView(printable(name), printable(row["rack"]), printable(row["ssh"]), printable(row["version"]),
                              silent if sane else math.inf, not sane or silent > lease, sane and silent <= lease + grace,
                              int(row["queued"]), int(row["queued_gpus"]), tuple(gpus)))
    return views


def held_by(fleet: Iterable[NodeView], user: str) -> int:
    """GPUs `user` holds on the nodes whose grants count."""
    return sum(1 for node in fleet if node.counted for gpu in node.gpus if user in gpu.holders)


def data_holders(path: str, data: Sequence[tuple[str, Sequence[str]]]) -> tuple[str, ...] | None:
    """The nodes or racks of the longest `[fleet.data]` path containing `path` (None: not mapped)."""
    path = path.rstrip("/") or "/"
    best = max((prefix for prefix, _ in data if path == prefix or path.startswith(prefix.rstrip("/") + "/")),
               key=len, default=None)
    return None if best is None else tuple(dict(data)[best])


def locality(node: NodeView, holders: Sequence[str], racks: Mapping[str, str]) -> int:
    if node.name in holders:
        return 0
    near = {racks.get(name, name) for name in holders}  # a holder is a node (its rack counts) or a rack
    return 1 if node.rack and node.rack in near else 2


def rank(fleet: Sequence[NodeView], user: str, fleet_gpus: int | None, wanted: int,
         holders: Sequence[str] | None, per_node: int | None = None) -> list[Choice]:
    """The servers for `user`, best first: first those where they may take `wanted` GPUs now,
    then by data locality (when holders is given), then the shorter queue, then more GPUs to
    take. What they may take on a node: its free GPUs less those its queue waits for, at most
    `per_node` (their quota on one server: the nodes share one quotas file) less what they hold
    there, within what is left of their fleet quota."""
    room = None if fleet_gpus is None else max(0, fleet_gpus - held_by(fleet, user))
    racks = {node.name: node.rack for node in fleet}

    def may_take(node: NodeView) -> int:
        caps = [node.open]
        if room is not None:
            caps.append(room)
        if per_node is not None:
            caps.append(per_node - sum(1 for gpu in node.gpus if user in gpu.holders))
        return max(0, min(caps))

    choices = [Choice(node, may_take(node), None if holders is None else locality(node, holders, racks))
               for node in fleet if not node.lost]
    return sorted(choices, key=lambda c: (c.may_take < wanted, c.locality or 0, c.node.queued, -c.may_take,
                                          c.node.name))
