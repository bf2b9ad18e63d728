"""Enforcement that checks and repairs itself: the kernel-side state made to match the store again.

The store is the truth; the gate (program, attachment, pins, grants map, exempt map) and the GPU
nodes (owner, mode, ACL) are derived from it and can drift behind the daemon's back: an admin's
`bpftool cgroup detach` or setfacl, an nvidia-caps module loaded since start, a bpffs remounted.
The daemon calls check_and_repair every few ticks, as fail2ban re-checks its actions, and logs
each line it returns. Deciding what should be is pure (wanted_entries, node_users); the writes go
through the Gate and devnodes, which change nothing that is already right.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from gpuguard.backends import devnodes
from gpuguard.backends.gate import Entry, Gate
from gpuguard.model import NVIDIA_MAJOR, Grant


def wanted_entries(grants: Iterable[Grant]) -> set[Entry]:
    """The gate's grants map as the store says it should be."""
    return {(g.uid, (NVIDIA_MAJOR, g.minor)) for g in grants}


def node_users(grants: Iterable[Grant], exempt: Collection[int], minors: Iterable[int]) -> dict[int, set[int]]:
    """minor -> the uids that need an ACL entry on its node, for each of `minors`: its grantees and,
    since the nodes are 0660 root:root, the exempt users too (never root, who needs none)."""
    users = {minor: set(exempt) - {0} for minor in minors}
    for grant in grants:
        if grant.minor in users:
            users[grant.minor].add(grant.uid)
    return users


def sync_nodes(device_dir: Path, users: Mapping[int, Collection[int]]) -> list[str]:
    """Make each GPU node users names present, 0660 root:root, with ACL entries for exactly its
    users; returns what was wrong."""
    fixed = []
    for minor, uids in sorted(users.items()):
        fixed += devnodes.sync_gpu_node(devnodes.gpu_node(device_dir, minor), (NVIDIA_MAJOR, minor), uids)
    return fixed


def check_and_repair(gate: Gate | None, grants: Collection[Grant], exempt: Collection[int],
                     device_dir: Path, minors: Collection[int]) -> list[str]:
    """One round: the gate attached, current and pinned (Gate.repair), its grants and exempt maps
    equal to the store's grants and the exempt uids, every GPU node's owner, mode and ACL right.
    gate None: acl mode, nodes only. Returns one line per thing that was wrong and is now
    repaired; empty when everything was right. Raises GateError or OSError when a repair fails."""
    repaired = []
    if gate is not None:
        repaired += [f"gate {gate.name}: {problem}" for problem in gate.repair(exempt)]
        removed, added = gate.set_entries(wanted_entries(grants))
        if removed:
            repaired.append(f"gate {gate.name}: map held grants the store does not: {_entries(removed)}")
        if added:
            repaired.append(f"gate {gate.name}: map lacked grants the store has: {_entries(added)}")
        if changed := gate.set_exempt(exempt):
            repaired.append(f"gate {gate.name}: exempt uids differed from the configured ones: {sorted(changed)}")
    return repaired + sync_nodes(device_dir, node_users(grants, exempt, minors))


def _entries(entries: Iterable[Entry]) -> str:
    return ", ".join(f"uid {uid} {major}:{minor}" for uid, (major, minor) in sorted(entries))
