"""Releasing session grants once their user has logged out and nothing of theirs uses them.

The rule is rules.unused_after_logout (pure); this is its edge: NVML's view comes from the
sample, and, for the grants about to go, a look in /proc for processes that hold a node open
without a CUDA context (NVML does not list those). Called at a user's last logout and each tick.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from gpuguard import rules
from gpuguard.grants import Grants
from gpuguard.holders import FindHolders
from gpuguard.sampling import Sample
from gpuguard.store import Store


class LogoutRelease:
    def __init__(self, store: Store, grants: Grants, find_holders: FindHolders):
        self.store = store
        self.grants = grants
        self.find_holders = find_holders

    def unused(self, sample: Sample, uids: Iterable[int] | None = None) -> dict[int, frozenset[int]]:
        """rules.unused_after_logout on the store and the sample, for these users (default: all)."""
        grants = self.store.grants()
        if uids is not None:
            wanted = set(uids)
            grants = [g for g in grants if g.uid in wanted]
        logged_in = {session.uid for session in self.store.sessions()}
        return rules.unused_after_logout(grants, logged_in, sample.busy_slots(), sample.minors)

    async def release_unused(self, sample: Sample, uids: Iterable[int] | None = None) -> None:
        """Release what unused() finds, after a /proc scan of those users' processes (not everyone's)."""
        candidates = self.unused(sample, uids)
        if not candidates:
            return
        held: dict[int, set[int]] = {}
        # Only the candidates' processes are read: a full scan of a busy machine takes seconds.
        for holder in await asyncio.to_thread(self.find_holders, set().union(*candidates.values()), set(candidates)):
            held.setdefault(holder.uid, set()).add(holder.minor)
        now = time.time()
        # Re-checked after the await: a login or a grant may have come in meanwhile.
        for uid, minors in self.unused(sample, candidates).items():
            if minors == candidates[uid] and not held.get(uid, set()) & minors:
                bound = [g.minor for g in self.store.grants(uid) if g.origin == "session"]
                self.grants.remove(uid, bound, now, kind="release", rule="logout",
                                   message="released: your last session ended and no process of yours used it")
