"""The daemon's side of a fleet: the grant-time check, the heartbeat, the offline policy and caches.

Everything that talks to the database runs on one worker thread (worker.OrderedWorker), in the
order the event loop asked (a heartbeat's snapshot and a check after it reach the database in that order). The
loop waits for a grant-time check at most `timeout` (a login never waits longer on the
network); a check that times out or fails puts the node offline, and from then on checks are
decided locally at once, under `offline_policy`, until a heartbeat succeeds again. The gate and
the local store are never touched by any of this: the fleet can only make a grant smaller.
A heartbeat or a check the database refuses because another install holds this node's name
(identity.py) puts the node offline the same way, and it keeps trying: it takes the name over
once the holder has been silent past lease + grace. The holder hears of the clash too.

Called from the event-loop thread only, like the store, except the worker's own calls.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg

from gpuguard import __version__
from gpuguard.config import FleetConfig, OfflinePolicy
from gpuguard.core import policy
from gpuguard.core.escape import printable
from gpuguard.core.model import Gpu, Grant, Origin, Quota
from gpuguard.core.quantities import format_duration
from gpuguard.fleet.identity import Identity, describe
from gpuguard.fleet.outbox import Outbox
from gpuguard.fleet.schema import CURRENT, FleetError
from gpuguard.fleet.worker import OrderedWorker
from gpuguard.logs import event
from gpuguard.services.edges import FleetDatabase
from gpuguard.services.store import Store

MIN_GAP = 0.5  # seconds between two heartbeats that grants taken back ask for: a request/release loop sends 2 a second
USAGE_FRESH = 60.0  # seconds: `fairshare` asks the heartbeat for every user's usage elsewhere at most this often
USAGE_WAIT = 3.0    # seconds `fairshare` waits for that heartbeat, then answers what it has


class RemoteUsage:
    """A user's recent usage (decayed GPU-seconds) on the fleet's other servers, as the queue
    orders by it (`node(user)`: the last heartbeat's, for the users waiting here), and every
    user's with any there (`everyone`, for `gpuguard fairshare`)."""

    def __init__(self, node: FleetNode):
        self.node = node

    def __call__(self, user: str) -> float:
        return float(self.node.usage.get(user, 0.0))

    async def everyone(self) -> tuple[dict[str, float], float | None]:
        """user -> usage elsewhere of every user with any there, and when the database said so
        (None: not yet). The heartbeat brings it (usage_all), asked at most once per USAGE_FRESH
        whoever calls and however often: a call that finds it older kicks a heartbeat and waits
        for it USAGE_WAIT at most. The users waiting here have their own heartbeat's number, the
        one the queue orders by."""
        node, now = self.node, time.time()
        if node.online and now - node.usage_all_asked >= USAGE_FRESH and (
                node.usage_all_at is None or now - node.usage_all_at >= USAGE_FRESH):
            node.usage_all_asked, node.usage_all_wanted = now, True
            node.kick()
        if node.usage_all_wanted and node.online:
            try:
                await asyncio.wait_for(node.usage_all_came.wait(), USAGE_WAIT)
            except asyncio.TimeoutError:  # not the builtin on Python 3.10
                pass
        return {**node.usage_all, **{user: float(value) for user, value in node.usage.items()}}, node.usage_all_at


class FleetNode:
    def __init__(self, config: FleetConfig, half_life: Callable[[], float], store: Store,
                 units: Callable[[], Mapping[int, Gpu]], foreign: Sequence[dict[str, Any]], outbox: Outbox,
                 db: FleetDatabase, identity: Identity):
        """units: what this node hands out now (Grants.gpus); foreign: the status entries of the GPUs
        Slurm or Kubernetes own here (coexist.status_entries), each with its `owner`; identity: this
        install's, sent with every call (another install under this node's name is refused)."""
        self.config = config
        self.half_life = half_life
        self.store = store
        self.units = units
        self.foreign = list(foreign)
        self.outbox = outbox
        self.db = db
        self.identity = identity
        self._worker = OrderedWorker("gpuguard-fleet")
        self.online = False  # until the first heartbeat: checks are local meanwhile
        self.stale_since: float | None = time.time()  # the fleet's view as this node has it is old since then
        self.last_beat: float | None = None
        self.offline_reason: str | None = None  # why the last call failed, while offline (a fenced database too)
        self.usage: dict[str, float] = {}   # recent usage elsewhere (fair share) of the users waiting here
        self.held: dict[str, int] = {}      # grants elsewhere of the users here, as last seen
        self.free: list[dict[str, Any]] = []  # where GPUs are free elsewhere, when this node is full
        # every user's usage elsewhere, for `fairshare` (RemoteUsage.everyone): as of usage_all_at
        self.usage_all: dict[str, float] = {}
        self.usage_all_at: float | None = None
        self.usage_all_asked = -math.inf  # when `fairshare` last asked the heartbeat for it
        self.usage_all_wanted = False     # the next heartbeat asks for it
        self.usage_all_came = asyncio.Event()  # set (and replaced) when a heartbeat brings it
        self.remote_usage = RemoteUsage(self)
        self.name_clash: str | None = None  # another install tried to use this node's name lately (the line)
        self._refused_by: str | None = None  # the install holding this node's name, while it refuses this one
        self._kick = asyncio.Event()

    # --- the grant-time check

    def admit(self, uid: int, user: str, quota: Quota, chosen: tuple[int, ...], now: float,
              expires_at: float | None, shared: bool, origin: Origin) -> tuple[int, ...]:
        """The part of `chosen` the fleet quota allows (all of it without one), recorded in the
        database in the same transaction. Waits `timeout` at most; offline: offline_policy.
        Without a fleet quota there is nothing to check: the grant goes to the database with the
        heartbeat it asks for (at most MIN_GAP after the last), so that a login storm costs the
        database a few heartbeats, not a round trip each, and a login no work on the worker."""
        if self.online and quota.fleet_gpus is None:
            self.kick()
            return chosen
        if self.online:
            doc = {"node": self.config.node, "install": self.identity.install, "incarnation": self.outbox.incarnation,
                   "user": user, "uid": uid,
                   # the key the released schema's reserve() reads (schema.py: never edited)
                   "cluster_gpus": quota.fleet_gpus,
                   "minors": list(chosen), "granted_at": now, "expires_at": expires_at, "shared": shared,
                   "origin": str(origin)}
            future = self._worker.submit(self.db.reserve, doc)
            try:
                result = future.result(timeout=self.config.timeout)
            except psycopg.errors.UniqueViolation:
                self._conflict(user, chosen)
                return ()
            except concurrent.futures.TimeoutError:
                self._offline(f"no answer within {self.config.timeout:g}s")
            except (psycopg.Error, FleetError) as exc:
                self._offline(_first_line(exc))
            else:
                self._skipped(result)
                if "refused" not in result:
                    self.held[user] = result["held"] - len(self.store.grants(uid))
                    return tuple(result["granted"])
                self._refused(result["refused"])
        return self._offline_admit(uid, user, quota, chosen)

    def _skipped(self, result: Mapping[str, Any]) -> None:
        """The rows the database refused from this node's role (schema.py, migration 7: a grant on a
        GPU it does not list or past the grants one GPU may have, a ledger row ending in the future
        or starting before the node joined): logged, the rest written."""
        if skipped := result.get("skipped"):
            event(logging.WARNING, "fleet_rows_refused", node=self.config.node, rows=skipped,
                  action="left out of the fleet database (check this server's clock and GPUs)")

    def _conflict(self, user: str, chosen: tuple[int, ...]) -> None:
        """The database has GPUs of this node granted that this node does not hold (its allocator
        chose them free). Another install under this node's name is refused before it writes
        (identity.py), so what it has is this node's own past: a release or a truth it has not
        received yet, after a reconnect (a switchover) or lost in a failover."""
        event(logging.ERROR, "fleet_grant_conflict", user=user, gpus=list(chosen), node=self.config.node,
              error="the fleet database still has these GPUs of this node granted, which this node no longer "
                    "holds: a release or heartbeat it has not received yet (a reconnect, or a failover that lost "
                    "the last commits)",
              action="refused here; this node's truth goes with the next heartbeat, soon")
        self._kick.set()

    def _offline_admit(self, uid: int, user: str, quota: Quota, chosen: tuple[int, ...]) -> tuple[int, ...]:
        if self.config.offline_policy == OfflinePolicy.LOCAL:
            return chosen
        room = policy.fleet_room(quota, self.held.get(user, 0), len(self.store.grants(uid)))
        return chosen if room is None else chosen[:max(0, room)]

    # --- the heartbeat

    def snapshot(self, now: float) -> dict[str, Any]:
        """This node's truth, as the heartbeat sends it (read from the store, on the loop thread)."""
        grants = self.store.grants()
        queue = self.store.queue()
        waiting = {q.waiter.user for q in queue}
        # Whose grants elsewhere to bring back (each costs the database that user's grant rows): the
        # waiters' at every heartbeat (the hint of `elsewhere`, the FleetQuota reason); the offline
        # budget's, every local user's, with the heartbeats that send the whole truth (FleetDb.heartbeat:
        # once a minute at least, and after a change here).
        budget: set[str] = set()
        if self.config.offline_policy == OfflinePolicy.BUDGET:
            budget = ({g.user for g in grants} | {s.user for s in self.store.sessions()}) - waiting
        units = self.units()
        free = len(set(units) - {g.unit for g in grants})
        return {
            "node": self.config.node, "host": self.identity.host, "install": self.identity.install,
            "rack": self.config.rack, "ssh": self.config.ssh or self.config.node,
            "version": __version__, "schema": CURRENT, "incarnation": self.outbox.incarnation,
            "heartbeat": self.config.heartbeat, "lease": self.config.lease, "grace": self.config.grace,
            "taken_at": now, "half_life": self.half_life(),
            # Every GPU, those Slurm or Kubernetes own too, with its owner: the fleet's views show
            # them, and only gpuguard's count as free (ranking.NodeView.free).
            "gpus": [*({"minor": gpu.unit, "uuid": gpu.uuid, "name": gpu.name, "memory_total": gpu.memory_total,
                        "owner": "gpuguard"} for gpu in units.values()),
                     *({"minor": gpu["minor"], "uuid": gpu["uuid"], "name": gpu["name"],
                        "memory_total": gpu["memory_total"], "owner": gpu["owner"]} for gpu in self.foreign)],
            "grants": [{"minor": g.unit, "username": g.user, "uid": g.uid, "granted_at": g.granted_at,
                        "expires_at": g.expires_at, "shared": g.shared, "origin": str(g.origin)} for g in grants],
            "queue": [{"ticket": q.waiter.id, "username": q.waiter.user, "gpus": q.waiter.gpus, "since": q.waiter.since,
                       "priority": q.waiter.priority} for q in queue],
            "ledger": self.outbox.pending(),
            "usage_for": sorted(waiting),
            "users": sorted(waiting),
            "budget_users": sorted(budget),
            "want_free": bool(queue) or free <= 1,
            "usage_all": self.usage_all_wanted,
        }

    async def beat(self) -> bool:
        """One heartbeat; True when the database took it."""
        doc = self.snapshot(time.time())
        kept_from = self.outbox.kept_from()
        try:
            result = await asyncio.wrap_future(self._worker.submit(self.db.heartbeat, doc, kept_from))
        except (psycopg.Error, FleetError) as exc:
            self._offline(_first_line(exc))
            return False
        if "refused" in result:
            self._refused(result["refused"])
            return False
        self._names(result)
        self._skipped(result)
        if doc["ledger"]:
            self.outbox.confirm(doc["ledger"][-1]["seq"], time.time())
        if "ledger_present" in result and (again := self.outbox.resend_absent(result["ledger_present"])):
            # a database reached anew lacks rows another one confirmed (a failover: outbox.py)
            event(logging.WARNING, "fleet_ledger_resent", node=self.config.node, rows=again)
            self._kick.set()
        # the budget's users as last asked, unless this heartbeat asked again
        held = {user: self.held[user] for user in doc["budget_users"] if user in self.held}
        self.usage, self.held, self.free = result["usage"], {**held, **result["held"]}, result["free"]
        if "usage_all" in result:
            self.usage_all, self.usage_all_at = result["usage_all"], result["at"]
            self.usage_all_wanted = False
            self.usage_all_came.set()
            self.usage_all_came = asyncio.Event()
        self.last_beat = time.time()
        if not self.online:
            event(logging.INFO, "fleet_online", node=self.config.node,
                  offline_for=round(time.time() - self.stale_since, 1) if self.stale_since else None)
        self.online, self.stale_since, self.offline_reason = True, None, None
        return True

    async def run(self) -> None:
        """A heartbeat every `heartbeat` seconds, and soon after grants are made without a check
        or taken back (they count at once against the fleet quota on the other servers)."""
        while True:
            started = time.monotonic()
            # cleared before the snapshot (beat takes it before its first await): a kick that comes
            # while this heartbeat is on its way is for what its snapshot lacks, and asks for the next
            self._kick.clear()
            try:
                await self.beat()
            except Exception:  # a bug of ours must not end the heartbeats: the next one tries again
                event(logging.ERROR, "fleet_heartbeat_failed", exc_info=True)
            try:
                await asyncio.wait_for(self._kick.wait(), self.config.heartbeat)
            except asyncio.TimeoutError:  # not the builtin on Python 3.10
                continue
            await asyncio.sleep(max(0.0, started + MIN_GAP - time.monotonic()))

    def ended(self, removed: list[Grant], now: float) -> None:
        """Grants taken back here (release.Releases.take_back): gone from the database with the
        heartbeat they ask for, or before any later check (FleetDb.release; the worker keeps the
        order, so the next grant of the same GPU finds it free there too), and their usage to the
        ledger through the outbox with that heartbeat."""
        self.outbox.add(removed, now)
        self._worker.submit(self.db.release, [(g.unit, g.user) for g in removed])
        if self.online:  # offline, the regular heartbeats try again: no point sending sooner
            self.kick()

    # --- the node's name (identity.py)

    def _refused(self, holder: dict[str, Any]) -> None:
        """Another install holds this node's name: offline, with one line naming both hosts
        (logged when the holder is new)."""
        line = (f"name taken: fleet node {self.config.node} is held by {describe(holder['host'], holder['install'])}, "
                f"seen {_ago(holder['silent_for'])} ago; refused here on {self.identity}: give each server its own "
                "[fleet] node name")
        if holder["install"] != self._refused_by:
            event(logging.ERROR, "fleet_name_taken", node=self.config.node, error=line,
                  policy=str(self.config.offline_policy),
                  action="offline: nothing written to the fleet database; taken over once the holder is silent "
                         "past lease + grace")
            self._refused_by = holder["install"]
        self._offline(line)

    def _names(self, result: Mapping[str, Any]) -> None:
        """What a heartbeat this install may make says of its name: taken over from a lost holder,
        or tried by another install lately (the clash line kept while it lasts, logged once)."""
        self._refused_by = None
        if lost := result.get("took_over"):
            event(logging.WARNING, "fleet_name_taken_over", node=self.config.node,
                  before=describe(lost["host"], lost["install"]), silent_for=round(lost["silent_for"], 1),
                  why="the node that held this name was silent past lease + grace (a reinstalled host?); if "
                      "another server still runs under it, give each its own [fleet] node name")
        clash = result.get("clash")
        line = None if clash is None else (
            f"name clash: {describe(clash['host'], clash['install'])} tried to join the fleet as node "
            f"{self.config.node}, which this host, {self.identity}, holds; it was refused: give each server its "
            "own [fleet] node name")
        if line is not None and line != self.name_clash:
            event(logging.WARNING, "fleet_name_clash", node=self.config.node, error=line)
        self.name_clash = line

    def _offline(self, why: str) -> None:
        self.offline_reason = why
        if self.online or self.stale_since is None:
            event(logging.WARNING, "fleet_offline", node=self.config.node, error=why,
                  policy=str(self.config.offline_policy))
        self.online = False
        if self.stale_since is None:
            self.stale_since = time.time()

    # --- what the other services read

    def kick(self) -> None:
        """A heartbeat soon (MIN_GAP after the last at the earliest)."""
        self._kick.set()

    def held_elsewhere(self, user: str) -> int | None:
        """The GPUs `user` holds on the other servers, as last seen (a grant-time check or a
        heartbeat: the users waiting here are asked about at each); None: not known."""
        return self.held.get(user)

    def elsewhere(self, user: str, quota: Quota) -> str:
        """For a login that queues here, holding nothing here: where GPUs are free for this user now
        ('' when nowhere, or not known)."""
        room = policy.fleet_room(quota, self.held.get(user, 0), 0)  # a login that queues holds nothing here
        if not self.online or (room is not None and room <= 0):
            return ""
        # Names from the database, printed on the user's terminal: printable only (ranking.nodes says why).
        places = [f"{printable(place['node'])} ({min(place['free'], room) if room is not None else place['free']})"
                  for place in self.free if place["free"] > 0]
        if not places:
            return ""
        # the ssh line is the node's own (only its role may set it): said so, not given as gpuguard's
        first = printable(self.free[0]["node"])
        return (f"; GPUs free now on {', '.join(places)}: ssh {printable(self.free[0]['ssh'] or self.free[0]['node'])} "
                f"({first}'s own ssh line)")

    def close(self) -> None:
        """A last heartbeat when online, waited for `timeout` at most: what was granted without a
        check or taken back since the last would otherwise reach the database only with this
        node's next start. Then the connection goes, on its own thread after what it is doing."""
        if self.online:
            last = self._worker.submit(self.db.heartbeat, self.snapshot(time.time()))
            try:
                last.result(timeout=self.config.timeout)
            except (psycopg.Error, FleetError, concurrent.futures.TimeoutError):
                pass  # the next start sends this node's whole truth
        self._worker.submit(self.db.close)
        self._worker.stop()
        self.outbox.close()


def _ago(seconds: float) -> str:
    return format_duration(round(max(0.0, seconds))) if seconds < 1e9 else "never"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
