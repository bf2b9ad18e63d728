"""Ending the processes that still hold a GPU node after the GPU was taken from their user.

The gate checks only at open(): a process that opened /dev/nvidiaN while its user held the GPU
keeps its descriptor, and the device behind it, until it exits. So every path that takes a GPU
away (an admin revoke, a time limit, an idle, logout or user release: Releases.take_back) ends the
user's processes that /proc shows holding that node:

- those NVML lists (a CUDA context) are the watcher's: on a GPU its user no longer holds they
  are stray use, warned, then SIGTERM after grace and SIGKILL after kill_wait (rules.py);
- the others, which NVML never shows and the watcher therefore never sees, get SIGTERM at once,
  SIGKILL `kill_wait` later if they still hold a node of those GPUs, and are reported
  unkillable if they still do `kill_wait` after that. When NVML cannot be read, every opener
  counts as one of these: the GPU was taken away, so access fails closed.

Each signal is re-checked against the process's identity (backends.signals, which also refuses
root and exempt processes), logged, and stored as an event of the user (`gpuguard whoami`). A
opener running as root (a setuid program that inherited the descriptor) is not signalled: that
too goes to the user's events, so they know what still holds their GPU.

A descriptor can be passed to any other process (SCM_RIGHTS over a unix socket), so after a GPU
is taken (a logout included) the openers of every uid are looked for as well, and ended the same
way unless their own user holds a grant that opens that node (a shared GPU, a slice of the same
GPU instance: `Grants.reaches`). A member's opener ended so is recorded in both users' events
(`gpuguard whoami`); a non-member's in the grantee's only (a user namespace has 65,536 uids). An
opener whose user NSS cannot look up is reported, not ended. Each is listed in a revoke's reply.
After a user's own release or a logout, the walk of /proc runs in the users' pool (scans.py), one
at a time, each shared by the releases and logouts that came while the one before ran.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from gpuguard.core.messages import unit_list
from gpuguard.core.model import Event, ProcessIdentity, Rule, SignalOutcome
from gpuguard.core.quantities import format_duration
from gpuguard.core.rules import Kind
from gpuguard.core.sample import MAX_AGE
from gpuguard.logs import Throttle, event
from gpuguard.services.edges import Clock, GpuSampler, Processes
from gpuguard.services.exempt import Exempt
from gpuguard.services.lookups import KnownAccounts
from gpuguard.services.scans import Scans
from gpuguard.services.store import Store

Pair = tuple[int, int]  # (pid, unit)


@dataclass(frozen=True)
class Scan:
    """A user's processes holding some GPUs' nodes, split by whether NVML lists them there."""

    listed: frozenset[Pair]    # NVML lists them (a CUDA context): the watcher's
    unlisted: frozenset[Pair]  # only /proc shows them (or NVML could not say)
    unread: frozenset[int]     # GPUs whose processes NVML could not read
    error: str | None = None   # NVML failed as a whole


@dataclass(frozen=True)
class Other:
    """An opener of another uid than the grantee's (a descriptor passed on)."""

    pid: int
    uid: int
    units: frozenset[int]
    ended: bool  # sent SIGTERM; False: reported (NSS could not say whose it is)


@dataclass(frozen=True)
class _Held:
    """What an opener being ended holds, and whose events its signals go to besides the grantee's."""

    units: frozenset[int]
    member: str | None = None  # the opener's user, a member other than the grantee: told too


@dataclass(frozen=True)
class Ending:
    """What end() did at once; SIGKILL and the unkillable report follow in the background."""

    scan: Scan
    termed: tuple[int, ...]  # pids sent SIGTERM
    others: tuple[Other, ...] = ()


# uid -> whether it is a member (True), not one (False), or NSS could not say (None)
IsMember = Callable[[int], Awaitable[bool | None]]
# (uid, units) -> those of the units whose nodes uid's own grants open (Grants.reaches)
Reaches = Callable[[int, Iterable[int]], frozenset[int]]


class OpenerEnder:
    def __init__(self, scans: Scans, sampler: GpuSampler, exempt: Exempt, store: Store,
                 kill_wait: Callable[[], float], processes: Processes, clock: Clock, *,
                 is_member: IsMember | None, reaches: Reaches, accounts: KnownAccounts):
        self.scans = scans
        self.is_member = is_member  # None: openers of other uids are not looked for
        self.reaches = reaches
        self.accounts = accounts  # the names of members whose openers are ended
        self.sampler = sampler
        self.exempt = exempt
        self.store = store
        self.kill_wait = kill_wait  # the config in force, which a reload replaces
        self.processes = processes
        self.clock = clock
        self._tasks: set[asyncio.Task[None]] = set()
        # Being seen through to SIGKILL: a later release finds them still holding, and must not
        # signal, log and record them all again (a user may pass a node to thousands of subuids).
        self._ending: set[ProcessIdentity] = set()
        # The log lines about one user's GPU's openers: a few a minute, then a count (the events
        # stored keep every one, within the events' per-user bound).
        self.log = Throttle("grantee", burst=20)
        self._unsaved: list[Event] = []  # recorded, to be stored in one transaction (_save)

    async def scan(self, uid: int, units: Collection[int], max_age: float = MAX_AGE,
                   for_user: bool = False) -> Scan:
        """uid's processes holding these GPUs' nodes (only that user's processes are read). /proc is
        scanned first: a process NVML does not list in the later sample had no context when it was found.
        for_user: a request of uid's asks (scans.Scans.for_user: bounded, one per uid at a time)."""
        units = frozenset(units)
        found = await (self.scans.for_user(uid, units) if for_user else self.scans.for_daemon(units, {uid}))
        holding = frozenset((h.pid, h.unit) for h in found if h.uid == uid)
        if not holding:
            # A CUDA process holds its node open too: none in /proc, none for NVML to list. No
            # sample then, so that releases (which can be looped) never make NVML poll faster.
            return Scan(frozenset(), frozenset(), frozenset())
        try:
            sample = await self.sampler.take(max_age)
        except Exception as exc:  # GpuError and anything a broken driver throws
            return Scan(frozenset(), holding, units, str(exc))
        listed = frozenset((p.pid, p.unit) for p in sample.processes
                           if p.unit in units and sample.uid_of(p.pid) == uid)
        return Scan(listed, holding - listed, frozenset(m for m in units if not sample.ok(m)))

    def schedule(self, uid: int, user: str, units: Iterable[int], why: Rule) -> None:
        """end() in the background (the caller is the event loop, which must not wait kill_wait)."""
        self._spawn(self.end(uid, user, units, why))

    async def end(self, uid: int, user: str, units: Iterable[int], why: Rule) -> Ending:
        """SIGTERM uid's processes holding these GPUs' nodes that NVML does not list, and see
        them through to SIGKILL in the background. `why` is the rule that took the GPUs."""
        # fresh: a context made a moment ago is the watcher's; after a user's own release, in the users' pool
        scan = await self.scan(uid, set(units), max_age=0, for_user=why == Rule.USER)
        holding: dict[int, set[int]] = {}
        for pid, unit in scan.unlisted:
            holding.setdefault(pid, set()).add(unit)
        termed: dict[ProcessIdentity, _Held] = {}
        for count, (pid, held) in enumerate(sorted(holding.items()), start=1):
            identity = self.processes.identity(pid)
            if identity is None or identity.uid != uid or identity in self._ending:
                continue  # exited since the scan, or being ended already
            if self._signal(identity, mine := _Held(frozenset(held)), user, signal.SIGTERM, why, uid):
                termed[identity] = mine
                self._ending.add(identity)
            await self._pause(count)
        try:
            others = await self._others(uid, user, frozenset(units), why, termed)
        finally:  # those signalled are seen through (and leave _ending) whatever the walk did
            self._save()
            if termed:
                self._spawn(self._escalate(user, termed, why, uid))
        return Ending(scan, tuple(identity.pid for identity in termed if identity.uid == uid), others)

    async def _others(self, uid: int, user: str, units: frozenset[int], why: Rule,
                      termed: dict[ProcessIdentity, _Held]) -> tuple[Other, ...]:
        """Openers of other uids (root and exempt users pass the gate anyway) on a node their own
        user holds no grant for get SIGTERM (added to `termed`); those NSS cannot say are reported."""
        if self.is_member is None or not units:
            return ()
        holding: dict[ProcessIdentity, set[int]] = {}
        # every process: a walk of all of /proc; after a user's own release or logout, in the users'
        # pool (one such walk at a time, shared by those asked for meanwhile), so that releases and
        # logins cannot queue host-sized walks ahead of the tick's scans
        walk = (self.scans.for_everyone(units) if why in (Rule.USER, Rule.LOGOUT)
                else self.scans.for_daemon(units, None))
        for opener in await walk:
            if opener.uid in (uid, 0) or opener.uid in self.exempt.uids:
                continue
            identity = self.processes.identity(opener.pid)
            if identity is not None and identity.uid == opener.uid and identity not in self._ending:
                holding.setdefault(identity, set()).add(opener.unit)
        others = []
        members: dict[int, str | bool | None] = {}  # asked once per uid: thousands of openers may share one
        for count, (identity, units_held) in enumerate(sorted(holding.items()), start=1):
            await self._pause(count)
            if identity in self._ending or not units_held - self.reaches(identity.uid, units_held):
                continue  # ended meanwhile, by another take-back; or on nodes its own user holds
            if identity.uid not in members:
                members[identity.uid] = await self._member(identity.uid)
            member = members[identity.uid]
            held = _Held(frozenset(units_held), member if isinstance(member, str) else None)
            if member is not None and self._signal(identity, held, user, signal.SIGTERM, why, uid):
                termed[identity] = held
                self._ending.add(identity)
                others.append(Other(identity.pid, identity.uid, held.units, True))
            elif member is None:
                self._record(identity, held, user, Kind.REPORT, why, {"opener_uid": identity.uid},
                             f"of uid {identity.uid} holds GPU {unit_list(held.units)}, which was yours ({why}): a "
                             "descriptor passed on; its user could not be looked up, so it is reported, not ended", uid)
                others.append(Other(identity.pid, identity.uid, held.units, False))
        return tuple(others)

    async def _member(self, uid: int) -> str | bool | None:
        """A member's name, False for a non-member, None when NSS cannot say."""
        assert self.is_member is not None  # _others looks for nobody without it
        member = await self.is_member(uid)
        if member is not True:
            return member
        await self.accounts.resolve([uid])
        return self.accounts.name_of(uid)

    async def _escalate(self, user: str, termed: dict[ProcessIdentity, _Held], why: Rule, uid: int) -> None:
        try:
            await asyncio.sleep(self.kill_wait())
            for count, identity in enumerate(await self._still_holding(termed), start=1):
                self._signal(identity, termed[identity], user, signal.SIGKILL, why, uid)
                await self._pause(count)
            self._save()
            await asyncio.sleep(self.kill_wait())
            for identity in await self._still_holding(termed):
                stuck = "survives SIGKILL (stuck in the kernel); an administrator must look at it"
                self._record(identity, termed[identity], user, Kind.UNKILLABLE, why, {
                    "state": self.processes.state(identity) or "unknown"}, stuck, uid, theirs=f"it {stuck}")
        finally:
            self._save()
            self._ending.difference_update(termed)

    async def _still_holding(self, termed: dict[ProcessIdentity, _Held]) -> list[ProcessIdentity]:
        """Those of `termed` that are the same process as before and still hold one of their nodes."""
        found = await self.scans.for_daemon(set().union(*(held.units for held in termed.values())),
                                            {identity.uid for identity in termed})
        holding = {(h.pid, h.unit) for h in found}
        return [identity for identity, held in termed.items()
                if any((identity.pid, m) in holding for m in held.units)
                and self.processes.identity(identity.pid) == identity]

    def _signal(self, identity: ProcessIdentity, held: _Held, user: str, sig: signal.Signals,
                why: Rule, uid: int) -> bool:
        """Signal an opener; its events go to uid (the user whose GPU it was), named `user`, and
        to the opener's user when a member."""
        result = self.processes.send(identity, sig, self.exempt.uids)
        units = unit_list(held.units)
        if not result.sent:
            self.log.event(uid, logging.INFO, "opener_signal_skipped", uid=identity.uid, pid=identity.pid,
                           signal=sig.name, outcome=result.outcome.value, detail=result.detail or None)
            if result.outcome is SignalOutcome.REFUSED and sig == signal.SIGTERM:  # runs as root: setuid
                self._record(identity, held, user, Kind.REPORT, why, {"euid": 0},
                             f"runs as root and holds GPU {units}, which is no longer yours ({why}); "
                             "gpuguard does not signal root's processes: end it yourself, or ask your admin", uid)
            return False
        wait = format_duration(round(self.kill_wait()))
        what = (f"stopping it with SIGTERM; it will be killed if it still holds the GPU in {wait}"
                if sig == signal.SIGTERM else f"killed it with SIGKILL: it still held the GPU {wait} after SIGTERM")
        whose = (f"holds GPU {units}, which is no longer yours" if identity.uid == uid else
                 f"of uid {identity.uid} holds GPU {units}, which was yours (a descriptor passed on)")
        action = Kind.TERM if sig == signal.SIGTERM else Kind.KILL
        self._record(identity, held, user, action, why, {"signal": sig.name, "kill_wait": self.kill_wait()},
                     f"{whose} ({why}); {what}", uid, theirs=what)
        return True

    def _record(self, identity: ProcessIdentity, held: _Held, user: str, action: Kind, why: Rule,
                numbers: dict[str, Any], what: str, uid: int, theirs: str | None = None) -> None:
        """Log, and store as an event of uid (named `user`): the opener's own, or the grantee's.
        theirs: what the opener's user is told, when a member (held.member), after why it holds."""
        command = self.processes.command(identity.pid)
        self.log.event(uid, logging.ERROR if action == Kind.UNKILLABLE else logging.WARNING, f"opener_{action}",
                       rule=why, user=user, uid=identity.uid, pid=identity.pid, command=command or None,
                       gpus=unit_list(held.units), **numbers)
        process = f"{identity.pid}" + (f" ({command})" if command else "")
        told = [(uid, user, f"gpuguard: {'your process' if identity.uid == uid else 'process'} {process} {what}")]
        if held.member is not None and theirs is not None:
            told.append((identity.uid, held.member,
                         f"gpuguard: your process {process} holds GPU {unit_list(held.units)} through a descriptor "
                         f"passed on from {user}, whose grant ended ({why}), and you hold no grant for it; {theirs}"))
        self._unsaved += [Event(self.clock(), to, name, action.event, message, unit=unit, pid=identity.pid,
                                command=command, rule=why, action=action, numbers=dict(numbers))
                          for to, name, message in told for unit in sorted(held.units)]

    def _save(self) -> None:
        """Store the events recorded since the last save, in one transaction: one each was a
        commit (an fsync) per opener, and a user may pass a node to thousands."""
        if self._unsaved:
            recorded, self._unsaved = self._unsaved, []
            self.store.add_events(recorded)

    async def _pause(self, count: int, every: int = 32) -> None:
        """Every `every` openers, store what was recorded and let the loop serve others (logins,
        the tick): each opener is a signal, a log line and an event."""
        if count % every == 0:
            self._save()
            await asyncio.sleep(0)

    def _spawn(self, work: Awaitable[object]) -> None:
        task = asyncio.get_running_loop().create_task(self._logged(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _logged(work: Awaitable[object]) -> None:
        try:
            await work
        except Exception:  # a failing end must not pass silently, nor stop the daemon
            event(logging.ERROR, "opener_end_failed", exc_info=True)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
