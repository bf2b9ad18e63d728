"""Releasing session grants once their user has logged out and nothing of theirs uses them.

The rule is rules.unused_after_logout (pure); this is its edge: NVML's view comes from the
sample, and, for the grants about to go, a look in /proc for the user's processes that hold a
node open without a CUDA context (NVML does not list those). Run at a user's last logout, in
the background so that the PAM module's reply never waits for NVML or /proc, and each tick.

A grant kept because such a process holds its node is not looked at again each tick: the
holders are watched through pidfds (backends.exits), and the next tick after one of them exits
looks again. A holder that closes the node but keeps running is seen at the latest
RECHECK_HELD later.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from operator import attrgetter

from gpuguard.core import rules
from gpuguard.core.model import EventKind, Grant, Origin, Rule
from gpuguard.core.sample import Sample
from gpuguard.logs import event
from gpuguard.services.edges import Cancel, Clock, ExitWatch, GpuSampler, Processes
from gpuguard.services.release import Releases
from gpuguard.services.scans import Scans
from gpuguard.services.store import Store

RECHECK_HELD = 60.0  # seconds between looks in /proc for a kept grant whose holders all still run
# Sessions whose PAM caller a tick looks for at most, in turn: each is a /proc read on the loop,
# and one user may hold thousands of sessions open.
CALLERS_PER_TICK = 256


@dataclass(frozen=True)
class _Kept:
    units: frozenset[int]
    since: float  # time.monotonic()
    cancel: Cancel  # stops watching the holders


class LogoutRelease:
    def __init__(self, store: Store, releases: Releases, scans: Scans, exits: ExitWatch,
                 processes: Processes, sampler: GpuSampler, clock: Clock = time.time):
        self.store = store
        self.sampler = sampler  # a sample for the check after a logout (reused when a second old)
        self.releases = releases
        self.scans = scans
        self.exits = exits
        self.processes = processes
        self.clock = clock
        self._kept: dict[int, _Kept] = {}  # uid -> grants kept for holders that are being watched
        self._pending: dict[int, asyncio.Task[None]] = {}  # uid -> its check after logout, running
        self._looked_up_to = -1  # the last session id drop_dead_sessions looked at

    def unused(self, sample: Sample, busy: Collection[rules.Slot], uids: Iterable[int] | None = None
               ) -> dict[int, frozenset[int]]:
        """rules.unused_after_logout on the store and the sample (busy: its busy_slots()), for these
        users (default: all)."""
        if uids is None:
            grants = self.store.grants()
        else:  # only theirs: a check after one logout costs that user's grants, not everyone's
            grants = [g for uid in sorted(set(uids)) for g in self.store.grants(uid)]
        logged_in = self.store.users_logged_in()
        return rules.unused_after_logout(grants, logged_in, busy, sample.units)

    def caller_alive(self, pid: int | None, start: int | None) -> bool:
        """A session's PAM caller (or a queued request's client) lives while a process with its pid
        and start time does. Start times count clock ticks since boot, so a stepped wall clock
        (chrony at boot) changes nothing. A session from before the store kept start times has none:
        then any process with the pid will do."""
        if pid is None:
            return False
        identity = self.processes.identity(pid)
        return identity is not None and (start is None or identity.start_time == start)

    def drop_dead_sessions(self) -> None:
        """Sessions whose PAM caller is gone without a close_session (crash, kill -9, lost
        message): a logout that never came. Each tick, CALLERS_PER_TICK sessions at most, the
        next ones by id in turn (beyond that many, one is found within a few ticks); the release
        check follows in the tick."""
        starts = self.store.caller_starts()
        sessions = self.store.sessions()
        after = bisect.bisect_right(sessions, self._looked_up_to, key=attrgetter("id"))
        turn = (sessions[after:] + sessions[:after])[:CALLERS_PER_TICK]
        self._looked_up_to = turn[-1].id if turn and len(sessions) > CALLERS_PER_TICK else -1
        gone = [s for s in turn if not self.caller_alive(s.pid, starts.get(s.id))]
        if gone:
            self.store.remove_sessions(s.id for s in gone)
            for session in gone:
                event(logging.INFO, "session_gone", user=session.user, session=session.id, pid=session.pid)

    def after_logout(self, uid: int) -> None:
        """Check uid's grants after their last logout, in the background (one check at a time)."""
        if uid not in self._pending:
            task = asyncio.get_running_loop().create_task(self._after_logout(uid))
            self._pending[uid] = task
            task.add_done_callback(lambda _: self._pending.pop(uid, None))

    async def _after_logout(self, uid: int) -> None:
        try:
            sample = await self.sampler.take_or_log("grants kept until a good sample")
            if sample is not None:  # no data, no release: the tick tries again
                await self.release_unused(sample, [uid])
        except Exception:  # the tick tries again; nobody else would see this
            event(logging.ERROR, "logout_release_failed", exc_info=True, uid=uid)

    async def settled(self) -> None:
        """Until the checks after logout started so far have ended."""
        await asyncio.gather(*self._pending.values())

    async def release_unused(self, sample: Sample, uids: Iterable[int] | None = None,
                             now: float | None = None) -> list[Grant]:
        """Release what unused() finds, unless /proc shows a process of its user holding one of
        its nodes: then the grant stays and those holders are watched. Only those users'
        processes are read. The releases are one batch of the release step (Releases), which
        also ends any holder that opened a node since this look. now: when (default: the
        clock's now). Returns the grants released."""
        busy = sample.busy_slots()
        candidates = self.unused(sample, busy, uids)
        for uid in list(self._kept if uids is None else set(uids) & self._kept.keys()):
            kept = self._kept[uid]
            if candidates.get(uid) != kept.units or time.monotonic() - kept.since >= RECHECK_HELD:
                self._forget(uid)
        to_check = {uid: units for uid, units in candidates.items() if uid not in self._kept}
        if not to_check:
            return []
        # Only the candidates' processes are read: a full scan of a busy machine takes seconds.
        holders = await self.scans.for_daemon(set().union(*to_check.values()), set(to_check))
        now = self.clock() if now is None else now
        released: list[Grant] = []
        # Re-checked after the await: a login or a grant may have come in meanwhile.
        with self.releases.batch(now):
            for uid, units in self.unused(sample, busy, to_check).items():
                if units != to_check[uid] or uid in self._kept:
                    continue
                pids = {h.pid for h in holders if h.uid == uid and h.unit in units}
                if pids:
                    self._watch(uid, units, pids)
                else:
                    bound = [g.unit for g in self.store.grants(uid) if g.origin == Origin.SESSION]
                    released += self.releases.take_back(
                        uid, bound, now, kind=EventKind.RELEASE, rule=Rule.LOGOUT,
                        message="released: your last session ended and no process of yours used it")
        return released

    def _watch(self, uid: int, units: frozenset[int], pids: Collection[int]) -> None:
        cancel = self.exits.watch(pids, uid, lambda: self._forget(uid))
        if cancel is not None:  # None: a holder is gone already, and the next tick looks again
            self._kept[uid] = _Kept(units, time.monotonic(), cancel)

    def _forget(self, uid: int) -> None:
        kept = self._kept.pop(uid, None)
        if kept is not None:
            kept.cancel()

    def close(self) -> None:
        for uid in list(self._kept):
            self._forget(uid)
        for task in self._pending.values():
            task.cancel()
