"""Giving and taking GPUs, choosing them included: the store records a grant, the gate and the
device ACLs follow from the store, and the allocator (pure) picks which GPUs a user gets.

Order is chosen so that what the kernel enforces never exceeds what the store says: a grant
is written to the store before the gate opens, a release closes the gate before the store
forgets. A crash in between therefore leaves, at worst, a grant the gate does not honour
yet, which reconcile() at the next start repairs.

Used by the API (logins, requests, admin commands), the logout release and the watcher
(expiry, idle release); all calls come from the event-loop thread, as the store requires.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpuguard import allocator, policy
from gpuguard.allocator import Topology
from gpuguard.backends.gate import Entry, Gate
from gpuguard.logs import event
from gpuguard.model import NVIDIA_MAJOR, Event, Gpu, Grant, Origin, Quota
from gpuguard.store import Store

if TYPE_CHECKING:
    from gpuguard.holders import HolderEnder

_NODE = re.compile(r"nvidia(\d+)")


class Nodes(Protocol):
    """The GPU device nodes (backends.gpu_nodes.AclNodes on a real machine)."""

    def path(self, minor: int) -> Path: ...

    def sync(self, minor: int, users: Collection[int]) -> list[str]:
        """Make the node exist, 0660 root:root, with an ACL entry for exactly `users`;
        returns what was wrong (empty when the node was right and nothing was written)."""


class Grants:
    def __init__(self, store: Store, gate: Gate | None, nodes: Nodes, minors: Collection[int],
                 exempt: Collection[int] = (), gpus: Mapping[int, Gpu] | None = None,
                 topology: Topology | None = None):
        self.store = store
        self.gate = gate  # None in access.mode = "acl": the ACLs are the only enforcement
        self.nodes = nodes
        self.minors = frozenset(minors)  # the GPUs this machine has: only their nodes are managed
        # What can be handed out: the GPUs NVML could read at start, and how they are linked.
        # Both are fixed while the driver stays loaded (a GPU that falls off the bus shows as
        # NVML errors in the tick, not as a smaller inventory).
        self.gpus: Mapping[int, Gpu] = dict(gpus or {})
        self.topology: Topology = dict(topology or {})
        # Exempt users pass the gate, but the nodes are 0660 root:root: they need ACL entries too.
        self.exempt = frozenset(exempt) - {0}
        # Ends the processes that still hold a node taken away (set by the daemon once built: it
        # needs the sampler and the exempt set); None where nothing runs (unit tests of this class).
        self.holders: HolderEnder | None = None
        # Told of every grant taken back, whatever took it (the queue: fair-share charge, then
        # the freed GPUs go to the waiters first).
        self.on_removed: list[Callable[[list[Grant], float], None]] = []

    def set_exempt(self, uids: Collection[int]) -> None:
        """Change the exempt users; every node's ACL follows at once."""
        uids = frozenset(uids) - {0}
        if uids != self.exempt:
            self.exempt = uids
            self.node_changed(None)

    def choose(self, uid: int, count: int, share: bool) -> tuple[int, ...]:
        """Up to `count` more GPUs for uid (allocator.choose over the current grants)."""
        return allocator.choose(list(self.gpus.values()), self.topology, self.store.grants(),
                                self.store.last_released(), uid, count, share, self.store.last_held(uid))

    def allocate(self, uid: int, user: str, quota: Quota, count: int, now: float, origin: Origin,
                 message: str) -> tuple[int, ...]:
        """Up to `count` more GPUs for the user on the terms of their quota (none when none is free)."""
        share = policy.may_share(quota)
        chosen = self.choose(uid, count, share)
        self.add(uid, user, chosen, now, expires_at=policy.expires_at(quota, now), shared=share,
                 origin=origin, message=message)
        return chosen

    def add(self, uid: int, user: str, minors: Iterable[int], now: float, *, expires_at: float | None,
            shared: bool, origin: Origin, message: str) -> None:
        minors = sorted(minors)
        if not minors:
            return
        self.store.add_grants(uid, user, minors, now, expires_at, shared=shared, origin=origin)
        try:
            if self.gate:
                for minor in minors:
                    self.gate.grant(uid, (NVIDIA_MAJOR, minor))
            self.sync_nodes(minors)
        except Exception:
            # Not enforceable: take it back, so the store never claims what the kernel does not do.
            self.remove(uid, minors, now, kind="error", rule=origin, message="grant could not be applied")
            raise
        for minor in minors:
            self.store.add_event(Event(now, uid, user, "grant", message, minor=minor, rule=origin, action="grant"))
        event(logging.INFO, "grant", user=user, uid=uid, gpus=minors, origin=origin, expires_at=expires_at,
              shared=shared or None)

    def remove(self, uid: int, minors: Iterable[int] | None, now: float, *, kind: str, rule: str,
               message: str, end_holders: bool = True) -> list[Grant]:
        """Take back a user's GPUs (all, or these minors). kind: release (the user's or an
        idle/logout release), revoke (an admin or a time limit), error. Returns what was held.

        The processes of the user still holding one of those nodes are then ended in the
        background (holders.HolderEnder), whichever path took the GPUs; a caller that wants to
        report on them passes end_holders=False and awaits HolderEnder.end itself."""
        wanted = None if minors is None else set(minors)
        held = [g for g in self.store.grants(uid) if wanted is None or g.minor in wanted]
        if not held:
            return []
        closed: list[Grant] = []
        try:
            if self.gate:
                for grant in held:
                    self.gate.revoke(uid, (NVIDIA_MAJOR, grant.minor))
                    closed.append(grant)
            self.store.remove_grants(uid, [g.minor for g in held], now)
        except Exception:
            # The store still has these grants: reopen the gate for them, so both agree again.
            for grant in closed:
                assert self.gate is not None  # only the gate closed anything
                self.gate.grant(uid, (NVIDIA_MAJOR, grant.minor))
            raise
        self.sync_nodes(g.minor for g in held)
        for grant in held:
            self.store.add_event(Event(now, uid, grant.user, kind, message, minor=grant.minor, rule=rule,
                                       action=kind))
        event(logging.INFO, kind, user=held[0].user, uid=uid, gpus=[g.minor for g in held], rule=rule)
        if self.holders is not None and end_holders and kind != "error":  # error: the gate never opened
            self.holders.schedule(uid, held[0].user, [g.minor for g in held], rule)
        for listener in self.on_removed:
            listener(held, now)
        return held

    def sync_nodes(self, minors: Iterable[int]) -> list[str]:
        """Make each /dev/nvidia<minor> exist, 0660 root:root, with an ACL entry for exactly its
        grantees and the exempt users; returns what was wrong. GPUs this machine no longer has are
        skipped: no node to manage."""
        grantees: dict[int, set[int]] = {}
        for grant in self.store.grants():  # one read, however many nodes
            grantees.setdefault(grant.minor, set()).add(grant.uid)
        fixed = []
        for minor in sorted(set(minors) & self.minors):
            fixed += self.nodes.sync(minor, grantees.get(minor, set()) | self.exempt)
        return fixed

    def node_changed(self, path: Path | None) -> None:
        """NodeWatcher callback: a node was (re)created or changed; None means check them all."""
        if path is None:
            self.sync_nodes(self.minors)
        elif match := _NODE.fullmatch(path.name):
            self.sync_nodes([int(match[1])])

    def reconcile(self) -> list[str]:
        """Rebuild the derived state from the store: gate entries exactly as granted, every node
        synced. Returns what was wrong, one line each (empty: all was right)."""
        repaired = []
        if self.gate:
            removed, added = self.gate.set_entries({(g.uid, (NVIDIA_MAJOR, g.minor)) for g in self.store.grants()})
            if removed:
                repaired.append(f"gate {self.gate.name}: map held grants the store does not: {_entries(removed)}")
            if added:
                repaired.append(f"gate {self.gate.name}: map lacked grants the store has: {_entries(added)}")
        return repaired + self.sync_nodes(self.minors)

    def check_and_repair(self) -> list[str]:
        """Enforcement that checks and repairs itself (the daemon calls this every few ticks and
        logs each line): the gate loaded, attached to the cgroup v2 root, pinned and running the
        program for the device ranges managed now (so an nvidia-caps module loaded since start is
        managed: Gate.repair), its exempt and grants maps as configured and as the store says, and
        every GPU node's owner, mode and ACL. Returns one line per thing that was wrong and is now
        repaired; empty when everything was right. Raises GateError or OSError when a repair fails."""
        repaired = []
        if self.gate:
            repaired += [f"gate {self.gate.name}: {problem}" for problem in self.gate.repair(self.exempt)]
            if changed := self.gate.set_exempt(self.exempt):
                repaired.append(f"gate {self.gate.name}: exempt uids differed from the configured ones: "
                                f"{sorted(changed)}")
        return repaired + self.reconcile()


def _entries(entries: Iterable[Entry]) -> str:
    return ", ".join(f"uid {uid} {major}:{minor}" for uid, (major, minor) in sorted(entries))
