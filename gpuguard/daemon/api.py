"""The daemon's operations, one method each, with the caller's identity from SO_PEERCRED.

Root may do everything. Any other user may look at the machine (status) and query,
request and release for themself only. A login (session_open) always gets an ok reply:
whatever fails inside is logged and the session opens without GPUs.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from gpuguard import config as configuration
from gpuguard import protocol
from gpuguard.config import Config
from gpuguard.core import allocator, inventory, policy, reporting, rules
from gpuguard.core.errors import GpuguardError, Refusal, UnknownUser
from gpuguard.core.messages import (
    WHOAMI_HINT,
    fleet_quota_message,
    grant_reply,
    in_use_message,
    number_list,
    queue_message,
    unit_list,
)
from gpuguard.core.model import Account, Event, EventKind, Grant, Origin, Quota, Rule, is_slice, unit_label, unit_parent
from gpuguard.core.quantities import format_duration, format_size
from gpuguard.daemon import admission
from gpuguard.daemon import requests as rq
from gpuguard.daemon.server import Peer
from gpuguard.logs import event
from gpuguard.services.asks import Answer, Ask, Outcome, Waits, Why
from gpuguard.services.drains import NotSaved
from gpuguard.services.logins import Login, Took
from gpuguard.services.openers import Scan
from gpuguard.services.queueing import Standing
from gpuguard.services.wiring import Services

WHOAMI_EVENTS = 20
NO_GPU_FREE = "gpuguard: no GPU is free right now; you are in the queue for one (gpuguard whoami)"
LOGIN_FAILED = "gpuguard: no GPU for this session (an internal error, logged for your admin)"
NO_QUOTA = "gpuguard: your quota allows no GPUs - run gpuguard whoami for details"


# (user, quota) -> text added to a queued login's message: where GPUs are free for them now
# (gpuguard.fleet.node.FleetNode.elsewhere; "" when nowhere or unknown)
Elsewhere = Callable[[str, Quota], str]


def nowhere_else(user: str, quota: Quota) -> str:
    """A lone server's Elsewhere: no other server to name."""
    return ""


class Api:
    """The operations: each parses nothing (requests.parse typed it), asks the services that decide
    (a login: Logins; a request: Asks; ...), and says what came of it in a reply."""

    def __init__(self, services: Services, reload: Callable[[], Config], sync_nodes: Callable[[], None]) -> None:
        """reload: the `reload` operation's work (the config it put in force); sync_nodes: the
        `sync_nodes` operation's (the daemon's, both)."""
        edges = services.edges
        self.config = edges.config  # the config in force, which a reload replaces
        self.store, self.grants, self.drains = services.store, services.grants, services.drains
        self.queue, self.holds, self.asks, self.tickets = services.queue, services.holds, services.asks, services.tickets
        self.logins, self.releases, self.openers = services.logins, services.releases, services.openers
        self.exempt, self.usage, self.history = services.exempt, services.usage, services.use_history
        self.accounts = services.accounts  # names and quotas as the watcher last resolved them: no NSS wait
        self.sampler, self.lookup, self.gate = edges.sampler, edges.lookup, edges.gate
        self.terminals, self.processes, self.clock = edges.terminals, edges.processes, edges.clock
        self.foreign = edges.foreign  # status entries of the GPUs Slurm or Kubernetes own (coexist)
        # A fleet's (gpuguard.fleet): for a login that queues, where GPUs are free for the user now.
        self.elsewhere: Elsewhere = services.fleet.node.elsewhere if services.fleet else nowhere_else
        self.apply_reload, self.resync_nodes = reload, sync_nodes
        self._releases = admission.RateLimit()  # each release scans /proc: per uid, a few at once
        # each request writes the store (a grant, or a queue place that a hang-up takes back and logs)
        self._requests = admission.RateLimit()
        # each report or events read goes through the caller's history on the loop (indexed by uid)
        self._records = admission.RateLimit()

    async def handle(self, request: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """Serve a decoded request (protocol.decode_request): root's operations are refused to
        anyone else before the request is read, then requests.parse types it or refuses it."""
        op = request["op"]
        try:
            if rq.kind_of(request).root_only and peer.uid != 0:
                return protocol.refused(f"{op} is for root only")
            reply: dict[str, Any] = await getattr(self, op)(rq.parse(request), peer)
            return reply
        except Refusal as exc:
            return protocol.refused(str(exc), exc.code)

    # --- logins

    async def session_open(self, request: rq.SessionOpen, peer: Peer) -> dict[str, Any]:
        user, pid = request.user, request.pid
        try:
            account = await self.lookup.by_name(user)  # before any state is read: the rest never awaits
            return self._login_reply(account, self.logins.open(account, request.service, request.rhost, request.tty,
                                                               pid, request.grant))
        except Exception as exc:
            # An unknown user is PAM's business, not a fault of ours: one line, no traceback.
            known = exc.line() if isinstance(exc, GpuguardError) else None
            event(logging.ERROR, "session_open_failed", exc_info=known is None, user=user, pid=pid, error=known)
            return protocol.ok(session=None, gpus=[], cuda_visible_devices="", message=LOGIN_FAILED)

    def _login_reply(self, account: Account, login: Login) -> dict[str, Any]:
        reply = protocol.ok(session=login.session.id, gpus=[], cuda_visible_devices="", message="")
        if login.took == Took.KEPT:  # a second session reuses the grant it already has
            return {**reply, **self._grant_reply(self.store.grants(account.uid))}
        if login.took == Took.NO_QUOTA:
            return {**reply, "message": NO_QUOTA}
        answer = login.answer
        if answer is None:  # exempt, an outsider, or a session that takes no GPUs of its own
            return reply
        if answer.outcome == Outcome.WAITING:
            standing = self.queue.standing(account.uid, self.clock())
            event(logging.INFO, "queued", user=account.name, wanted=answer.wanted,
                  position=standing.position if standing else None)
            # A session without a terminal (a spawner's, `ssh host cmd`) reads no line: the user's terminals are told.
            then = ("you will be told here when it is yours" if policy.is_terminal(login.session.tty) else
                    "your terminals will be told when it is yours")
            if standing is None:
                message = NO_GPU_FREE
            elif standing.fleet_quota is not None:
                message = fleet_quota_message(standing.fleet_quota, standing.fleet_elsewhere, standing.position,
                                              standing.waiting, then)
            else:
                message = queue_message(standing.position, standing.waiting, standing.gpus, standing.estimate, then)
            return {**reply, "queue": _standing_info(standing), "message": message + self.elsewhere(account.name, answer.quota)}
        held = self.store.grants(account.uid)
        if not held:
            return {**reply, "message": NO_GPU_FREE}
        return {**reply, **self._grant_reply(held, wanted=answer.wanted)}

    async def session_close(self, request: rq.SessionClose, peer: Peer) -> dict[str, Any]:
        logout = self.logins.close(await self._account_named(request.user), request.pid)
        return protocol.ok(closed=logout.closed is not None, held=sorted(logout.held),
                           release_pending=logout.release_pending)

    # --- looking

    async def whoami(self, request: rq.Whoami, peer: Peer) -> dict[str, Any]:
        account = await self._subject(request.user, peer)
        store, config = self.store, self.config()
        access = config.access
        quota = policy.quota_for(account.name, account.groups, config)
        return protocol.ok(
            user=account.name, uid=account.uid, group=access.group,
            member=policy.is_member(account.groups, access),
            exempt=self.asks.eligibility(account) == policy.Eligibility.EXEMPT,
            quota=asdict(quota),
            grants=[self._grant_info(g, quota) for g in store.grants(account.uid)],
            sessions=[asdict(s) for s in store.sessions(account.uid)],
            events=[protocol.record(e) for e in store.events(account.uid, WHOAMI_EVENTS)],
            usage=store.usage(account.uid),
            queue=self._queue_info(account.uid, self.clock()))

    def _queue_info(self, uid: int, now: float) -> dict[str, Any] | None:
        """The user's place in the queue, with what holds the GPUs (messages.queue_why says it in words)."""
        info = _standing_info(self.queue.standing(uid, now))
        if info is None:
            return None
        holders = [{"minor": g.unit, "user": g.user, "expires_at": g.expires_at, "idle": max(0.0, now - g.last_active),
                    "reclaim_after": self.accounts.of(g.uid)[1].reclaim_after}
                   for g in self.store.grants() if g.uid != uid]
        held = any(q.waiter.id in self.holds.ids for q in self.store.queue(uid))
        return {**info, "holders": holders, "free": self.queue.free(), "held": held}

    async def status(self, request: rq.Status, peer: Peer) -> dict[str, Any]:
        config = self.config()
        sample = self.sampler.last
        commands = await self.sampler.commands(sample.owners) if sample else {}
        now = self.clock()
        gpus = reporting.status_gpus(self.grants.gpus, self.store.grants(), sample, self.accounts.of, commands)
        for gpu in gpus:
            drained = self.drains.get(unit_parent(gpu["minor"]))
            gpu["drained"] = None if drained is None else asdict(drained)
        gpus = sorted([*gpus, *self.foreign], key=lambda gpu: gpu["minor"])
        reply = protocol.ok(gpus=gpus, sampled_at=sample.time if sample else None, now=now,
                            group=config.access.group,
                            queue=[{"position": i, "user": q.waiter.user, "gpus": q.waiter.gpus,
                                    "since": q.waiter.since, "priority": q.waiter.priority,
                                    "waited": now - q.waiter.since, "reason": why}
                                   for i, (q, why) in enumerate(self.queue.reasons(now), start=1)])
        if peer.uid == 0:
            reply.update(sessions=[asdict(s) for s in self.store.sessions()],
                         exempt=sorted(self.exempt.uids), mode=config.access.mode,
                         gate=self.gate.name if self.gate and self.gate.is_attached() else None)
        return reply

    async def fairshare(self, request: rq.Fairshare, peer: Peer) -> dict[str, Any]:
        """Every user's fair-share standing, like Slurm's sshare: recent usage (decayed GPU-seconds)
        here and, in a fleet, on the other servers (as of the heartbeat that last brought it:
        FleetUsage.everyone, at most one database read a minute however often this is asked), their
        sum, share, and sum / share, which orders the queue after priority (lower first). Users with
        usage only elsewhere are listed when this server knows their name. Anyone may look."""
        now, config = self.clock(), self.config()
        uids = set(self.store.fairshare()) | {g.uid for g in self.store.grants()} | {
            q.waiter.uid for q in self.store.queue()}
        here = self.queue.usage(now, uids)
        fleet = await self.queue.usage_elsewhere()
        elsewhere, elsewhere_at = fleet if fleet is not None else ({}, None)
        # Names and quotas as the watcher keeps them (deleted since: the uid and the defaults, its
        # usage counting until it decays): NSS asked once a minute per user, not once per call
        # for every user ever charged, for anyone who asks.
        await self.accounts.resolve(uids)
        found: dict[int, tuple[str, Quota]] = {uid: self.accounts.of(uid) for uid in uids}
        # those known only elsewhere, by name (one this server cannot name cannot wait here)
        named = await self.accounts.by_names(sorted(set(elsewhere) - {name for name, _ in found.values()}))
        found = {**named, **found}
        users: list[dict[str, Any]] = []
        for uid, (name, quota) in found.items():
            mine, theirs = here.get(uid, 0.0), float(elsewhere.get(name, 0.0))
            users.append({"user": name, "uid": uid, "usage": mine + theirs, "here": mine, "elsewhere": theirs,
                          "share": quota.share, "priority": quota.priority, "normalized": (mine + theirs) / quota.share})
        users.sort(key=lambda u: (-u["priority"], u["normalized"], u["user"]))
        return protocol.ok(users=users, half_life=config.scheduler.half_life, now=now, fleet=fleet is not None,
                           elsewhere_at=elsewhere_at)

    async def gpus(self, request: rq.Gpus, peer: Peer) -> dict[str, Any]:
        """`gpuguard gpus` for anyone: from what the daemon read already (no NVML call of its own)."""
        sample, grants = self.sampler.last, self.grants
        found = inventory.view(
            grants.physical.values(), [unit for unit in grants.gpus.values() if unit.slice is not None],
            sample.layout.unread if sample and sample.layout else (), grants.topology,
            Counter(p.unit for p in sample.processes) if sample else Counter(), sample.use if sample else None)
        held = self.store.grants()
        for gpu in found["gpus"]:
            gpu.update(reporting.fractions(grants.gpus[gpu["minor"]], held) if gpu["minor"] in grants.gpus else
                       {"fractions": [], "memory_promised": 0, "memory_left": None})  # a GPU in MIG mode: its slices
        found["gpus"] = sorted([*found["gpus"], *inventory.foreign(self.foreign)], key=lambda gpu: gpu["minor"])
        return protocol.ok(**found)

    # --- records: usage report and event history (root: anyone's or everyone's; a user: their own)

    async def report(self, request: rq.Report, peer: Peer) -> dict[str, Any]:
        uid = await self._records_of(request.user, peer)
        since, until = request.period(self.clock())
        by = request.by
        self.usage.flush()  # a report made now includes the last tick
        rows = self.store.usage_by(by, since, until, uid)
        return protocol.ok(by=by, since=since, until=until, **reporting.report(rows))

    async def use_history(self, request: rq.UseHistory, peer: Peer) -> dict[str, Any]:
        """Utilisation and memory over the last hour, day or week (services.use_history): every
        GPU's, as `status` shows them to anyone; users' as records are read: the caller's own (from
        their budget for reports), root's and the web's account everyone's."""
        own = await self._reads_only(peer)
        uids = None
        if own is not None:
            if wait := self._records.allow(peer.uid, time.monotonic()):
                raise Refusal(f"too many reports at once from your user; try again in {math.ceil(wait)}s")
            uids = {peer.uid}
        trace = self.history.read(request.span, uids, self.clock())
        await self.accounts.resolve(trace.uids)  # names (NSS off the loop); a user deleted since keeps their uid
        return protocol.ok(span=request.span, **trace.reply(self.grants.gpus, self.accounts.name_of))

    async def events(self, request: rq.Events, peer: Peer) -> dict[str, Any]:
        uid = await self._records_of(request.user, peer)
        since, until = request.period(self.clock())
        found = self.store.find_events(uid, since, until, request.rule, request.limit)
        return protocol.ok(events=[protocol.record(e) for e in found])

    async def _records_of(self, name: str | None, peer: Peer) -> int | None:
        """Whose records a request naming user `name` may read: the caller's own; root's, anyone's
        (None: everyone's). Root may name an account deleted since: its records keep the uid it had."""
        own = await self._reads_only(peer)
        if own is not None:
            if name is not None and name != own:
                raise Refusal("only root may look at another user's records")
            if wait := self._records.allow(peer.uid, time.monotonic()):
                raise Refusal(f"too many reports at once from your user; try again in {math.ceil(wait)}s")
            return peer.uid
        if name is None:
            return None
        try:
            uid = (await self.lookup.by_name(name)).uid
        except UnknownUser:
            recorded = self.store.known_uid(name)
            if recorded is None:
                raise Refusal(f"no such user: {name}", 2) from None
            uid = recorded
        # The web view asks on a user's behalf: charged to that user, as if they asked themselves.
        if peer.uid != 0 and (wait := self._records.allow(uid, time.monotonic())):
            raise Refusal(f"too many reports at once from {name}; try again in {math.ceil(wait)}s")
        return uid

    # --- a user's own GPUs

    async def request(self, request: rq.Request, peer: Peer) -> dict[str, Any]:
        if wait := self._requests.allow(peer.uid, time.monotonic()):
            raise Refusal(f"too many requests at once from your user; try again in {math.ceil(wait)}s")
        account = await self._account_of(peer)
        caller = self.processes.identity(peer.pid)  # its place in the queue lives while this client does
        now = self.clock()
        answer = self.asks.ask(Ask(account, request.gpus, Origin.REQUEST, Waits.YES if request.wait else Waits.NEVER,
                                   "requested with gpuguard request",
                                   keeps=tuple(g.unit for g in self.store.grants(account.uid)),
                                   pid=peer.pid, pid_start=caller.start_time if caller else None,
                                   memory=request.memory), now)
        if answer.outcome == Outcome.REFUSED:
            raise Refusal(self._refused(answer))
        if answer.outcome == Outcome.WAITING:
            assert answer.place is not None  # a place is what waiting is
            return protocol.ok(queued=True, ticket=answer.place.waiter.id, granted=list(answer.granted),
                               login_place=answer.place.origin == Origin.SESSION,
                               **(_standing_info(self.queue.standing(account.uid, now)) or {}))
        held = self.store.grants(account.uid)
        if not held:
            raise Refusal("no GPU is free right now; try again later (gpuguard status shows who holds them)")
        return protocol.ok(granted=list(answer.granted),
                           **self._grant_reply(held, wanted=answer.wanted, new=answer.granted or None))

    def _refused(self, answer: Answer) -> str:
        """Why `gpuguard request` got nothing, in the words its user reads."""
        quota, why = answer.quota, answer.why
        if why == Why.EXEMPT:
            return "you are exempt: every GPU is open to you without a grant"
        if why == Why.OUTSIDER:
            return f"only members of group {self.config().access.group} get GPUs; ask your admin"
        if why == Why.OVER_QUOTA:
            return f"your quota is {quota.gpus} GPU{'s' if quota.gpus != 1 else ''} (gpuguard whoami)"
        if why == Why.TOO_BIG:
            most = answer.capacity
            return (f"this server has {most} GPU{'s' if most != 1 else ''} of a kind your quota takes; "
                    f"you asked for {answer.wanted} (gpuguard status shows them)")
        if why == Why.COOLING_DOWN:
            assert answer.until is not None and quota.reclaim_after is not None  # what a cool-down is
            left = max(1, math.ceil(answer.until - self.clock()))
            return (f"your time limit ended your last turn on this kind of GPU; the next starts after a cool-down of "
                    f"{format_duration(quota.reclaim_after)}, in {format_duration(left)}"
                    f" (gpuguard request --wait queues for it)")
        if why == Why.FRACTION_SIZE:
            low, high = answer.bounds
            return (f"a fraction here is {format_size(low)} to {format_size(high)} of one GPU's memory "
                    f"(your quota and the largest GPU; gpuguard whoami)")
        if why == Why.MAX_FRACTIONS:
            if not (most := policy.fraction_limit(quota)):
                return "your quota takes no fractions of a GPU (gpuguard whoami shows it; ask your admin)"
            return (f"you hold {most} fraction{'s' if most != 1 else ''} of a GPU already, your most "
                    f"(gpuguard release gives one back)")
        if why == Why.ALREADY_WAITING:
            return ("no GPU is free right now; you are in the queue already (gpuguard whoami shows your place); "
                    "gpuguard request --wait waits for your turn")
        return ("no GPU is free right now; gpuguard request --wait queues for one "
                "(gpuguard status shows who holds them and who waits)")

    async def wait(self, request: rq.Wait, peer: Peer) -> dict[str, Any]:
        """Block until a queued request (`ticket`, from request --wait) is granted, or `limit`
        seconds pass (then it leaves the queue). A client that hangs up leaves it too: the
        server cancels this call."""
        units = await self.tickets.wait(request.ticket, peer.uid, request.limit)
        return protocol.ok(queued=False, granted=list(units),
                           **self._grant_reply(self.store.grants(peer.uid), new=units))

    async def release(self, request: rq.Release, peer: Peer) -> dict[str, Any]:
        """Give GPUs back. It kills nothing: a GPU a process of the user still uses is kept, named
        with the pids, so no job loses its GPU by surprise. Without --gpu the idle ones go and the
        busy ones stay (refused only when all are busy), and a place in the queue is left too."""
        store = self.store
        if wait := self._releases.allow(peer.uid, time.monotonic()):
            raise Refusal(f"too many releases at once from your user; try again in {math.ceil(wait)}s")
        account = await self._account_of(peer)
        held = {g.unit for g in store.grants(account.uid)}
        units = self._units(request.units)
        left = self.tickets.leave_all(account.uid) if units is None else 0
        if not held:
            if left:
                return protocol.ok(released=[], kept=[], left_queue=left, gpus=[], cuda_visible_devices="",
                                   message="gpuguard: you held no GPU; you left the queue")
            raise Refusal("you hold no GPU")
        if units is not None and set(units) - held:
            raise Refusal(f"you do not hold GPU {unit_list(set(units) - held)} (you hold {unit_list(held)})")
        targets = set(units) if units is not None else held
        scan = _readable(await self.openers.scan(account.uid, targets, for_user=True))
        busy = scan.listed | scan.unlisted
        kept = {unit for _, unit in busy}
        in_use = in_use_message(kept, {pid for pid, _ in busy})
        if kept and (units is not None or kept == targets):
            raise Refusal(f"GPU {unit_list(kept)} {'are' if len(kept) > 1 else 'is'} {in_use}")
        removed = self.releases.take_back(account.uid, targets - kept, self.clock(), kind=EventKind.RELEASE,
                                          rule=Rule.USER, message="released with gpuguard release")
        released = [g.unit for g in removed]
        parts = [f"released GPU {unit_list(released)}"]
        if kept:
            parts.append(f"GPU {unit_list(kept)} stays, {in_use}")
        if still := held - set(released) - kept:
            parts.append(f"you still hold GPU {unit_list(still)}")
        if left:
            parts.append("you left the queue")
        return protocol.ok(released=released, kept=sorted(kept), left_queue=left,
                           **{**self._grant_reply(store.grants(account.uid)), "message": f"gpuguard: {'; '.join(parts)}"})

    async def cancel(self, request: rq.Cancel, peer: Peer) -> dict[str, Any]:
        """Leave the queue (`gpuguard cancel`, `request --cancel`): every request of the caller's,
        a login's place included, like scancel; root may take out another user's (`--user`), who is
        told. GPUs already held stay."""
        name = request.user
        if name is not None and peer.uid != 0:
            raise Refusal("only root may take another user's requests out of the queue")
        account = await (self._account_named(name) if name is not None else self._account_of(peer))
        waiting = self.queue.standing(account.uid, self.clock())
        if not self.tickets.leave_all(account.uid):
            raise Refusal("you are not in the queue (gpuguard whoami shows your GPUs)" if name is None else
                          f"{name} is not in the queue")
        where = f"number {waiting.position} of {waiting.waiting}" if waiting else ""
        if name is None:
            return protocol.ok(message=f"gpuguard: you left the queue{f' (you were {where})' if where else ''}; "
                                       "your GPUs, if any, stay yours")
        self.terminals.tell(account.name, account.uid, "gpuguard: root took your request out of the queue; ask your "
                           "admin why - gpuguard whoami", self.store.ttys(account.uid))
        return protocol.ok(message=f"gpuguard: took {account.name}'s requests out of the queue"
                                   f"{f' ({where})' if where else ''}; they were told")

    # --- admin

    async def grant(self, request: rq.Grant, peer: Peer) -> dict[str, Any]:
        store, config = self.store, self.config()
        account = await self._account_named(request.user)
        count, units, duration = request.gpus, self._units(request.units), request.duration
        eligible = self.asks.eligibility(account)
        if eligible == policy.Eligibility.EXEMPT:
            raise Refusal(f"{account.name} is exempt: every GPU is open to them already")
        if eligible == policy.Eligibility.OUTSIDER:
            raise Refusal(f"{account.name} is not in group {config.access.group}: only members get GPUs")
        quota = policy.quota_for(account.name, account.groups, config)
        share = policy.may_share(quota)
        if units is not None:
            blocked = allocator.blocking(store.grants(), account.uid, units, share, self.grants.gpus, quota)
            if blocked:
                raise Refusal(f"GPU {unit_list({g.unit for g in blocked})} is held by "
                              f"{', '.join(sorted({g.user for g in blocked}))}; revoke it first")
            chosen = tuple(units)
        else:
            assert count is not None  # the request names either units or a count
            chosen = self.grants.choose(account.uid, count, quota)
            if len(chosen) < count:
                raise Refusal(f"only {len(chosen)} more GPU{'s' if len(chosen) != 1 else ''} free for "
                              f"{account.name}, {count} asked")
        now = self.clock()
        expires_at = now + duration if duration is not None else policy.expires_at(quota, now)
        term = f" for {format_duration(duration)}" if duration is not None else ""
        self.grants.add(account.uid, account.name, chosen, now, expires_at=expires_at, shared=share,
                          origin=Origin.ADMIN, message=f"granted by root{term}", memory=quota.gpu_memory)
        return protocol.ok(user=account.name, gpus=sorted(chosen), expires_at=expires_at,
                           message=f"granted GPU {unit_list(chosen)} to {account.name}{term}")

    async def revoke(self, request: rq.Revoke, peer: Peer) -> dict[str, Any]:
        """Take GPUs back. The gate stops new opens at once, and the processes that opened a
        GPU before are ended: the watcher warns and stops those NVML lists (stray use), and
        those only /proc shows, which the watcher never sees, get SIGTERM here and SIGKILL
        kill_wait later if they still hold it (openers.OpenerEnder)."""
        store = self.store
        name, units = request.user, self._units(request.units)
        uid: int | None
        try:
            uid = (await self.lookup.by_name(name)).uid
        except UnknownUser:  # an account deleted while holding GPUs can still be revoked
            uid = next((g.uid for g in store.grants() if g.user == name), None)
        if uid is None:
            raise Refusal(f"no such user: {name}", 2)
        removed = self.releases.take_back(uid, units, self.clock(), kind=EventKind.REVOKE, rule=Rule.ADMIN,
                                          message="revoked by root", end_openers=False)
        if not removed:
            raise Refusal(f"{name} holds {'no GPU' if units is None else 'none of GPU ' + unit_list(units)}")
        revoked = {g.unit for g in removed}
        ending = await self.openers.end(uid, removed[0].user, revoked, Rule.ADMIN)
        scan = ending.scan
        note = f"; cannot see the GPUs' processes right now ({scan.error})" if scan.error else ""
        if scan.listed:  # the gate only checks at open(): the watcher warns these as stray use and ends them
            grace = format_duration(self.config().watcher.grace)
            note += (f"; still open in process {number_list({pid for pid, _ in scan.listed})}: warned now, "
                     f"stopped in {grace} by the watcher")
        if ending.termed:
            wait = format_duration(round(self.config().watcher.kill_wait))
            note += (f"; process {number_list(ending.termed)} held the node open (no CUDA context): sent SIGTERM, "
                     f"SIGKILL in {wait} if it still holds it")
        if ended := [o.pid for o in ending.others if o.ended]:
            note += f"; process {number_list(ended)} of other users held it too, with no grant of it: sent SIGTERM"
        if reported := [o.pid for o in ending.others if not o.ended]:
            note += f"; process {number_list(reported)} of users NSS could not look up hold it too: reported"
        holders = sorted(scan.listed | scan.unlisted)
        return protocol.ok(user=name, revoked=sorted(revoked),
                           holders=[{"pid": pid, "minor": unit} for pid, unit in holders],
                           other_holders=[{"pid": o.pid, "uid": o.uid, "units": sorted(o.units), "ended": o.ended}
                                          for o in ending.others],
                           message=f"revoked GPU {unit_list(revoked)} from {name}{note}")

    async def hold(self, request: rq.Hold, peer: Peer) -> dict[str, Any]:
        """Hold a user's queued requests (`gpuguard hold USER`), or let them go again (`off`): a held
        request keeps its place but is not served, and reserves nothing, like Slurm's scontrol hold."""
        account, off = await self._account_named(request.user), request.off
        ids = {q.waiter.id for q in self.store.queue(account.uid)}
        if not ids:
            raise Refusal(f"{account.name} is not in the queue")
        with _saved():
            (self.holds.release if off else self.holds.hold)(ids)
        event(logging.INFO, "unhold" if off else "hold", user=account.name, requests=len(ids))
        if off:
            self.queue.dispatch(self.clock())
            return protocol.ok(message=f"gpuguard: {account.name}'s request goes on in the queue")
        self.terminals.tell(account.name, account.uid, "gpuguard: root holds your request in the queue: it keeps its "
                           "place but is not served until released - ask your admin",
                           self.store.ttys(account.uid))
        return protocol.ok(message=f"gpuguard: held {account.name}'s request in the queue; they were told")

    async def drain(self, request: rq.Drain, peer: Peer) -> dict[str, Any]:
        """Give these GPUs to nobody new (`gpuguard drain`): their holders keep them and are told."""
        minors, reason = self._named_units(request.units), request.reason
        if any(is_slice(m) for m in minors):
            raise Refusal(rq.DRAIN_WHOLE, 2)
        now = self.clock()
        with _saved():
            self.drains.drain(minors, reason, now)
        why = f" ({reason})" if reason else ""
        for grant in self.store.grants():
            if unit_parent(grant.unit) in minors:
                text = (f"gpuguard: GPU {unit_label(grant.unit)} is being drained by root{why}: it stays yours until "
                        "you release it, but will not be given again until resumed - gpuguard whoami")
                self.store.add_event(Event(now, grant.uid, grant.user, EventKind.WARNING, text, unit=grant.unit,
                                           rule=Rule.DRAIN, action="warn"))
                self.terminals.tell(grant.user, grant.uid, text, self.store.ttys(grant.uid))
        event(logging.WARNING, "drain", gpu=unit_list(minors), reason=reason or None)
        return protocol.ok(drained=minors, message=f"gpuguard: drained GPU {unit_list(minors)}{why}; holders told")

    async def resume(self, request: rq.Resume, peer: Peer) -> dict[str, Any]:
        minors = self._named_units(request.units)
        if not_drained := [m for m in minors if m not in self.drains]:
            raise Refusal(f"GPU {unit_list(not_drained)} is not drained")
        with _saved():
            self.drains.resume(minors)
        event(logging.INFO, "resume", gpu=unit_list(minors))
        self.queue.dispatch(self.clock())  # the queue first, as with any GPU that comes free
        return protocol.ok(resumed=minors, message=f"gpuguard: GPU {unit_list(minors)} may be given again")

    async def sync_nodes(self, request: rq.SyncNodes, peer: Peer) -> dict[str, Any]:
        """Make missing driver nodes and re-apply every node's ACL; run by udev through
        `gpuguard acl apply`. Reads no config, so an admin's half-edited file blocks nothing."""
        self.resync_nodes()
        return protocol.ok(message="device nodes and ACLs re-applied")

    async def reload(self, request: rq.Reload, peer: Peer) -> dict[str, Any]:
        try:
            loaded = self.apply_reload()
        except configuration.ConfigError as exc:
            event(logging.ERROR, "reload_failed", error=str(exc), kept="previous config")
            raise Refusal(f"{exc} (the previous config stays in force)", 2) from None
        return protocol.ok(message=f"reloaded {loaded.source}")

    # --- shared pieces

    def _units(self, named: rq.Units | None) -> list[int] | None:
        """The units a request names (None: it names none), as numbers; a UUID names one unit,
        whatever the numbering. Refused when one is not on this machine."""
        return None if named is None else self._named_units(named)

    def _named_units(self, named: rq.Units) -> list[int]:
        gpus = self.grants.gpus
        by_uuid = {gpu.uuid: unit for unit, gpu in gpus.items()} if any(isinstance(u, str) for u in named) else {}
        if unknown_uuids := [u for u in named if isinstance(u, str) and u not in by_uuid]:
            raise Refusal(f"--gpu: no GPU or MIG slice {protocol.shown(unknown_uuids[0])} on this machine", 2)
        units = {by_uuid[u] if isinstance(u, str) else u for u in named}
        if unknown := units - set(gpus):
            raise Refusal(f"no GPU {unit_list(unknown)} on this machine (GPUs: {unit_list(gpus)})", 2)
        return sorted(units)

    def _grant_info(self, grant: Grant, quota: Quota) -> dict[str, Any]:
        gpu = self.grants.gpus.get(grant.unit)
        # a shared grant is a fraction of its GPU: the GPU's memory, the others' fractions, what is left to promise
        shares = reporting.fractions(gpu, self.store.grants()) if gpu and grant.shared else None
        return {**protocol.record(grant), "uuid": gpu.uuid if gpu else grant.uuid or None, "name": gpu.name if gpu else None,
                "index": gpu.index if gpu else None,
                "drained": asdict(drain) if (drain := self.drains.get(unit_parent(grant.unit))) else None,
                "memory_used": self._memory_used(grant), "memory_total": gpu.memory_total if gpu else None,
                "memory_limit": rules.memory_limit(grant, quota),  # what the watcher holds it to
                "shared_with": [f for f in shares["fractions"] if f["uid"] != grant.uid] if shares else [],
                "memory_left": shares["memory_left"] if shares else None}

    def _memory_used(self, grant: Grant) -> int | None:
        """What the grant's user's processes use of its unit at the last sample (None: not read),
        which whoami sets against the quota."""
        sample = self.sampler.last
        if sample is None or not sample.ok(grant.unit):
            return None
        return sum(p.used_memory for p in sample.processes
                   if p.unit == grant.unit and p.used_memory is not None and sample.uid_of(p.pid) == grant.uid)

    def _grant_reply(self, held: list[Grant], wanted: int | None = None, ending: str = WHOAMI_HINT,
                     new: Collection[int] | None = None) -> dict[str, Any]:
        """gpus, cuda_visible_devices and the one-line message for what a user holds (messages.grant_reply)."""
        return grant_reply(self.grants.gpus, held, wanted, ending, new)

    # --- who is asking (NSS, off the event loop)

    async def _account_named(self, name: str) -> Account:
        try:
            return await self.lookup.by_name(name)
        except UnknownUser as exc:
            raise Refusal(str(exc), 2) from None

    async def _account_of(self, peer: Peer) -> Account:
        try:
            return await self.lookup.by_uid(peer.uid)
        except UnknownUser as exc:
            raise Refusal(str(exc)) from None

    async def _subject(self, name: str | None, peer: Peer) -> Account:
        """The caller (name None), or (root only) the user named."""
        if name is None:
            return await self._account_of(peer)
        own = await self._reads_only(peer)
        if own is not None and own != name:
            raise Refusal("only root may look at another user's GPUs")
        return await self._account_named(name)

    async def _reads_only(self, peer: Peer) -> str | None:
        """Whose GPUs and records the caller may look at: their own (their name), or anyone's
        (None): root, and the web view's account, which reads as root does. The one place that says so."""
        if peer.uid == 0:
            return None
        own = (await self._account_of(peer)).name
        return None if own == self.config().web.user else own


def _readable(scan: Scan) -> Scan:
    """The scan, or a Refusal when NVML could not say which processes use those GPUs: an NVML
    error is not "no process"."""
    if scan.error:
        raise Refusal(f"cannot see the GPUs' processes right now ({scan.error}); try again")
    if scan.unread:
        raise Refusal(f"cannot see the processes on GPU {unit_list(scan.unread)} right now (NVML error); try again")
    return scan


def _standing_info(standing: Standing | None) -> dict[str, Any] | None:
    """A user's place in the queue as the protocol carries it (None: not waiting)."""
    if standing is None:
        return None
    return {**asdict(standing), "ahead": [{"user": user, "why": why} for user, why in standing.ahead]}


@contextmanager
def _saved() -> Iterator[None]:
    """An admin's change (a drain, a hold) in force, but not written to its file: said, not hidden."""
    try:
        yield
    except NotSaved as exc:
        raise Refusal(f"in force until a restart, but not saved: {exc}") from None
