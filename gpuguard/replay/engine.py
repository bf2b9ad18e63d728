"""`gpuguard replay`: replay a trace on a virtual clock through the daemon's own services.

The services are the daemon's, built by the same services.wiring.build; only the edges differ:
the clock is virtual, the GPU sample is the jobs running at that moment (_ReplayGpus), the
trace's users are accounts in access.group (_ReplayAccounts), a signal to a job's process ends
the job (_ReplayProcesses), the store is a scratch file without fsync (Edges.virtual), and there
are no device nodes, gate, terminals or /proc openers (Edges.find_openers None: no opener
scans). The replay decides nothing itself: logins and logouts are Logins.open / close (and the
logout release after it), a job's request is Asks.ask, the one path a login and `gpuguard
request` take (whose queue serves the waiters), and every release, revoke and stop is an action
of Watcher.check, but for a batch job's own release as it ends (Releases.take_back, as
`gpuguard release` ends).

The replay: a session opens (a login with grant "never": jobs ask for their GPUs); each job asks
for its GPUs, counting its user's idle granted ones that no other waiting job of theirs counts on,
as `gpuguard request --wait` would, but whole (a job cannot start on part of its GPUs) and with a
place of its own (each job of a batch waits for itself; those it counts on are the row's
`counted`: one a rule takes back while it waits is asked for again, Queue.keep_total), and runs
on exactly its count once they are granted: the time between is its time to GPU. A job still
waiting when its session ends never runs (its waiter leaves the queue with the last session); an
open session (no end in the trace: a batch job) ends once its last job has run, and gives its
GPUs back as it ends, as a job script's last `gpuguard release` does and as Slurm frees a job's
GPUs (its user may have other jobs running, so that logout is not their last). While a job runs
its process is on its GPUs, so the watcher sees them busy. Jobs sharing a GPU progress at 1/n
each while n jobs are on it (a job on several GPUs at the pace of its most crowded one): its end
moves when another job joins or leaves.

The watcher is driven as replay/watching.py says (ReplayWatch): a check after every batch of
simultaneous events that made a rule due at once (rules.acts_on_demand, acts_on_grant_change,
acts_on_arrival; or a job arrived or started once a rule's moment had come and its tick not yet),
and at the next of the rules' moments (Watcher.next_moment), rounded up to the watcher's interval
as the daemon's tick would see it. A batch that only took things away (job ends, logouts), or
gave GPUs to jobs that run on them at once, just adds the moments of the grants the jobs left
(ReplayWatch.next_moment_of): every limit is at least a second, and nothing else moves earlier.
When a job ends, the watcher's memory of when it saw the job last is set to that moment, as the
daemon's tick just before it would have left it.

Fractions (replay(fractions=True), `gpuguard replay --fractions`): a job on one GPU whose
gpu_memory is more than 0 and less than a replayed GPU's (GPU_MEMORY) asks for that much of one
GPU (Ask.memory, as `gpuguard request --memory` does) instead of a whole one, and runs on it at
its trace duration: a fraction's duration is the task's on its share of the GPU, so fractions
whose promises fit the GPU together do not slow each other (whole jobs sharing a GPU still do).
It runs on an idle fraction of its user's that promises at least its memory, where there is one,
as a script's second step in one allocation would. While a fraction waits in the queue, the
replay counts the GPUs left unallocatable (Result.unallocatable), FGD's measure of
fragmentation for the waiting demand: the memory not promised on each GPU that holds only
fractions and has less of it left than the smallest waiting fraction, in GPUs' worth (a GPU with
a tenth of its memory stranded so is 0.1), time-averaged over the moments a fraction waits; and
how many GPUs strand it. Free GPUs and GPUs held whole strand nothing. (The count alone would
call a GPU packed to its last GiB unallocatable, and punish the placements that pack best.)
Whole-GPU jobs (every job but those a fraction could serve: more than one GPU, or memory unknown
or a whole GPU's) have their wait kept apart, with fractions on and off alike, so that the two
runs compare the same jobs.

Beside it, in the same run, static reservation: each session holds the GPUs of its largest job
from its start to its end (an open one to its last job's end), sessions served first come first
served, a session that waits is shifted by its wait (its jobs then wait as long).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuguard import logs
from gpuguard.config import AccessConfig, Config, EventsConfig
from gpuguard.core import policy, rules
from gpuguard.core.model import (
    Account,
    EventKind,
    Gpu,
    GpuProcess,
    Grant,
    Origin,
    Placement,
    ProcessIdentity,
    Quota,
    Rule,
    SignalOutcome,
    SignalResult,
)
from gpuguard.core.sample import Sample
from gpuguard.replay.trace import Job, Session
from gpuguard.replay.watching import ReplayWatch
from gpuguard.services import wiring
from gpuguard.services.asks import Ask, Outcome, Waits
from gpuguard.services.store import GrantChanges, Queued, Store, grant_key

FIRST_UID = 100000
GPU_MEMORY = 80 << 30  # each replayed GPU's memory (an 80 GiB H100 or A100)


def fractional(job: Job) -> bool:
    """Whether a fraction of one replayed GPU could serve the job: one GPU, part of its memory."""
    return job.gpus == 1 and 0 < job.memory < GPU_MEMORY



class _GrantsSeen:
    """The store's grants as last counted, and what came and went since: the store's changes
    (Store.grant_changes), no step per grant that stayed; at the first look, every grant there is
    came."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._counted: dict[tuple[int, int, float], Grant] = {}  # the grants as last counted, by grant_key
        self._since = GrantChanges()

    def since(self) -> GrantChanges:
        """What came and went since the grants were last counted."""
        changes = self.store.grant_changes()
        if changes is None:  # the first look: the store follows its changes from here on
            for grant in self.store.grants_read():
                self._since.arrived(grant)
        else:
            self._since.add(changes)
        return self._since

    def count(self, end: bool = False) -> GrantChanges:
        """What came and went since the grants were last counted (at the end: every grant went),
        now counted."""
        changes = self.since()
        for grant in changes.gone:
            del self._counted[grant_key(grant)]
        for grant in changes.came:
            self._counted[grant_key(grant)] = grant
        if end:
            changes = GrantChanges()
            for grant in self._counted.values():
                changes.went(grant)
            self._counted = {}
        self._since = GrantChanges()
        return changes


@dataclass
class Result:
    """What one policy did with the trace (seconds and counts). Every job is counted: one that
    never ran (dropped with its session, over quota, or still waiting at the end) has a censored
    time to GPU, up to when it left (or the end of the replay)."""

    granted: float = 0.0             # GPU-seconds granted
    busy: float = 0.0                # GPU-seconds with at least one job on the GPU (one job's worth at most)
    shared: float = 0.0              # of busy: GPU-seconds with two jobs or more on the GPU
    demanded: float = 0.0            # GPU-seconds the jobs asked for
    work_lost: float = 0.0           # GPU-seconds of work thrown away: jobs stopped by a rule, from their start
    span: float = 0.0                # seconds from the first login to the last event
    waits: list[float] = field(default_factory=list)     # time to GPU of each job that ran
    completions: list[float] = field(default_factory=list)  # wait + run of each job that ran
    censored: list[float] = field(default_factory=list)  # time waited by each job that never ran
    stretch: list[float] = field(default_factory=list)   # run time / trace duration of each job that ended by itself
    never_ran: int = 0
    over_quota: int = 0              # of never_ran: asked for more GPUs than the quota allows (or the pool has)
    releases: int = 0                # idle and logout releases (GPU grants)
    reclaims: int = 0
    revokes: int = 0                 # time limit
    kills: int = 0                   # jobs ended by a rule
    most_sharers: int = 0            # the most jobs seen on one GPU at once (1 unless users share)
    per_user: dict[str, list[float]] = field(default_factory=dict)  # user -> [granted, demanded]
    user_waits: dict[str, list[float]] = field(default_factory=dict)     # user -> every job's (censored) wait
    user_slowdown: dict[str, list[float]] = field(default_factory=dict)  # user -> [sum of slowdowns, jobs]
    # Fractions (the module's text): every (censored) wait of whole-GPU jobs and of those a
    # fraction could serve; while a fraction waited: seconds (None: not measured, fractions off),
    # GPU-seconds unallocatable (GPUs' worth of memory stranded) and GPUs stranding it, by seconds
    whole_waits: list[float] = field(default_factory=list)
    fraction_waits: list[float] = field(default_factory=list)
    fraction_waiting: float | None = None
    unallocatable: float = 0.0
    stranding: float = 0.0

    def count(self, user: str, wait: float, duration: float, ran: float | None, whole: bool = True) -> None:
        """One job's outcome: waited `wait`, then ran `ran` seconds of wall time (None: never ran,
        so its wait is censored). Its slowdown is (wait + run) / duration, where a job that never
        ran or was stopped still needs its whole duration (it runs again from scratch). whole:
        a whole-GPU job (not one a fraction could serve: fractional())."""
        (self.whole_waits if whole else self.fraction_waits).append(wait)
        if ran is None:
            self.censored.append(wait)
        else:
            self.waits.append(wait)
            self.completions.append(wait + ran)
        self.user_waits.setdefault(user, []).append(wait)
        slowdown = self.user_slowdown.setdefault(user, [0.0, 0])
        slowdown[0] += (wait + (duration if ran is None else ran)) / duration
        slowdown[1] += 1

    def summary(self, gpus: int) -> dict[str, float | int | None]:
        waits = sorted(self.waits)
        every = sorted(self.waits + self.censored)
        censored = sorted(self.censored)
        stretch = sorted(self.stretch)
        completions = sorted(self.completions)
        shares = [g / d for g, d in self.per_user.values() if d > 0]
        slowdowns = [total / jobs for total, jobs in self.user_slowdown.values() if jobs]
        user_p95 = sorted(percentile(sorted(w), 0.95) or 0.0 for w in self.user_waits.values())
        waited = self.fraction_waiting
        return {
            "gpu_seconds_granted": round(self.granted, 1),
            "gpu_seconds_busy": round(self.busy, 1),
            "gpu_seconds_shared": round(self.shared, 1),
            "gpu_seconds_lost": round(self.work_lost, 1),
            "lost_of_demanded": round(self.work_lost / self.demanded, 4) if self.demanded else None,
            "busy_of_granted": round(self.busy / self.granted, 4) if self.granted else None,
            "pool_busy": round(self.busy / (gpus * self.span), 4) if self.span else None,
            "wait_p50": percentile(every, 0.50),
            "wait_p95": percentile(every, 0.95),
            "wait_max": every[-1] if every else None,
            "jct_mean": round(sum(completions) / len(completions), 1) if completions else None,
            "jct_p95": percentile(completions, 0.95),
            "ran_wait_p95": percentile(waits, 0.95),
            "ran_wait_max": waits[-1] if waits else None,
            "censored_wait_p95": percentile(censored, 0.95),
            "user_wait_p95_median": percentile(user_p95, 0.50),
            "user_wait_p95_worst": user_p95[-1] if user_p95 else None,
            "jobs": len(every),
            "jobs_ran": len(waits),
            "jobs_never_ran": self.never_ran,
            "jobs_over_quota": self.over_quota,
            "jobs_dropped": self.never_ran - self.over_quota,
            "jain": round(jain(shares), 4) if shares else None,
            "jain_slowdown": round(jain(slowdowns), 4) if slowdowns else None,
            "slowdown_worst_user": round(max(slowdowns), 2) if slowdowns else None,
            "stretch_mean": round(sum(stretch) / len(stretch), 4) if stretch else None,
            "stretch_p95": round(percentile(stretch, 0.95) or 0.0, 4) if stretch else None,
            "releases": self.releases,
            "reclaims": self.reclaims,
            "revokes": self.revokes,
            "kills": self.kills,
            "most_sharers": self.most_sharers,
            "whole_wait_p95": percentile(sorted(self.whole_waits), 0.95),
            "fraction_wait_p95": percentile(sorted(self.fraction_waits), 0.95),
            "fraction_waiting_of_span": round(waited / self.span, 4) if waited is not None and self.span else None,
            "unallocatable_gpus": self._while_waiting(self.unallocatable),
            "stranding_gpus": self._while_waiting(self.stranding),
        }

    def _while_waiting(self, total: float) -> float | None:
        """A time integral over the moments a fraction waited, as its mean over them."""
        waited = self.fraction_waiting
        if waited is None:
            return None
        return round(total / waited, 4) if waited else 0.0


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2), 1 when all are equal, 1/n at worst."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


class _ReplayGpus:
    """The GPU sampler edge: every sample is the running jobs' processes, as NVML would list them."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay
        self.errors: dict[str, int] = {}

    @property
    def last(self) -> Sample:
        return self.replay.sample()

    async def take(self, max_age: float = 0.0) -> Sample:
        return self.replay.sample()

    async def take_or_log(self, action: str, max_age: float = 0.0, **fields: Any) -> Sample | None:
        return self.replay.sample()

    async def commands(self, pids: Iterable[int]) -> dict[int, str]:
        return {pid: "replayed job" for pid in pids}


class _ReplayAccounts:
    """The NSS edge: each trace user is an account in access.group, numbered from FIRST_UID."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay

    async def by_name(self, name: str) -> Account:
        return self.replay.account(name)

    async def by_uid(self, uid: int) -> Account:
        return self.replay.account(self.replay.names[uid])

    async def exempt_uids(self, access: AccessConfig, logged_in: Collection[int]) -> frozenset[int]:
        return frozenset({0})

    def close(self) -> None:
        pass


class _ReplayProcesses:
    """The processes edge: a job's process is its pid; a signal to it ends the job there."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay

    def identity(self, pid: int) -> ProcessIdentity | None:
        running = self.replay.running.get(pid)
        return ProcessIdentity(pid, running.uid, pid) if running else None

    def command(self, pid: int) -> str:
        return "replayed job"

    def state(self, identity: ProcessIdentity) -> str | None:
        return None

    def send(self, identity: ProcessIdentity, sig: int, exempt: Collection[int] = ()) -> SignalResult:
        if self.identity(identity.pid) != identity:
            return SignalResult(SignalOutcome.GONE, "the job has ended")
        self.replay.stopped(identity.pid)
        return SignalResult(SignalOutcome.SENT)


class _Nowhere:
    """The edges a replay has none of: device nodes, terminals, exit watches."""

    def sync(self, device: tuple[int, int], users: Collection[int]) -> list[str]:
        return []

    def tell(self, user: str, uid: int, message: str, ttys: Iterable[str] = ()) -> None:
        pass

    def close(self) -> None:
        pass

    def watch(self, pids: Collection[int], uid: int, on_exit: Callable[[], None]) -> None:
        return None


@dataclass
class _Running:
    """A job on its GPUs. Its work is its trace duration; it progresses at `rate` (1 alone; 1/n
    while its most crowded GPU has n jobs on it), so it ends when the work is done."""

    job: Job
    user: str
    uid: int
    session: int
    units: tuple[int, ...]
    pid: int
    arrived: float
    started: float
    left: float          # seconds of work still to do at `since`
    processes: tuple[GpuProcess, ...]  # its process on each of its GPUs, as NVML lists it
    identity: ProcessIdentity          # who that process is, as /proc tells
    rate: float = 1.0
    since: float = 0.0
    version: int = 0     # its end event is for this version; an older one is stale
    fraction: bool = False  # on a fraction of its GPU: at its own pace, whoever else is there


@dataclass
class _Session:
    uid: int
    user: str
    jobs_left: int
    open: bool           # no end in the trace: it ends once its last job has run
    closed: bool = False  # logged out (its jobs may still wait, until the user's last session ends)


class Replay:
    """One replay of the configured policy on a pool of `gpus` GPUs (use it once); fractions:
    a job a fraction could serve asks for one (the module's text)."""

    def __init__(self, config: Config, gpus: int, scratch: Path, fractions: bool = False):
        self.config = config
        self.fractions = fractions
        inventory = {m: Gpu(m, m, f"GPU-replay-{m}", "replay", f"replay:{m}", GPU_MEMORY, 0, None, None)
                     for m in range(gpus)}
        nowhere = _Nowhere()
        # No event history: nobody reads a replay's (recording it was a sixth of the month's time).
        services_config = replace(config, events=EventsConfig(max_age=None, per_user=0))
        self.services = wiring.build(wiring.Edges(
            config=lambda: services_config, store_path=scratch / "state.db", sampler=_ReplayGpus(self), units=inventory,
            driver_minors=range(gpus), nodes=nowhere, lookup=_ReplayAccounts(self), terminals=nowhere,
            exits=nowhere, find_openers=None, processes=_ReplayProcesses(self), clock=lambda: self.now,
            virtual=True))
        self.store, self.grants, self.queue = self.services.store, self.services.grants, self.services.queue
        self.logins, self.asks = self.services.logins, self.services.asks
        self.watch = ReplayWatch(self.services)
        self.queue.listeners.append(self._served)
        self.result = Result()
        self.now = 0.0
        self.uids: dict[str, int] = {}
        self.names: dict[int, str] = {}
        self.quotas: dict[str, Quota] = {}
        self.running: dict[int, _Running] = {}    # pid -> job
        self.on_gpu: dict[int, set[int]] = {}     # unit -> pids of the jobs on it
        self.busy_since: dict[int, float] = {}    # unit -> when its job count last changed
        self.busy_of: dict[int, Counter[int]] = {}  # uid -> units its jobs are on (how many jobs each)
        self.pending: dict[int, dict[int, tuple[Job, int]]] = {}  # uid -> queue row id -> (job, session pid)
        self.sessions: dict[int, _Session] = {}   # session pid -> its user and jobs still to run
        self._joining: tuple[Job, int] | None = None  # the job whose request is being queued
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._pids = itertools.count(1000)
        self._next_wake: float | None = None
        # When a rule may next act, as next_change named it (the wake is that, on the tick after):
        # till then a process arriving is acted on only where rules.acts_on_arrival says so.
        self._due = math.inf
        self._first: float | None = None
        self._added = False                       # this batch of events started a job a rule may act on at once
        self._went_idle: set[rules.Slot] = set()  # this batch's (uid, unit) whose jobs left
        self._wanted = rules.Demand()             # the queue's demand as the last batch of events left it
        self._sample: Sample | None = None        # the sample of the running jobs, until one starts or ends
        self._taken_back = 0                      # grants taken back (released or revoked), for the counts
        self._seen = _GrantsSeen(self.store)      # the store's grants after the last batch of events
        # Since when the queue and the grants stood as measured last (a fraction waiting, the GPUs
        # unallocatable and stranded for it then), while fractions are replayed
        self._measured: tuple[float, bool, float, int] = (0.0, False, 0.0, 0)
        if fractions:
            self.result.fraction_waiting = 0.0

    # --- the event loop

    async def run(self, sessions: Iterable[Session]) -> Result:
        upcoming: Iterator[Session] = iter(sessions)
        following = next(upcoming, None)
        while following is not None or self._events:
            # Read the trace only as far as the clock: memory holds the open sessions, not the file.
            while following is not None and (not self._events or following.start <= self._events[0][0]):
                self._open_at(following)
                following = next(upcoming, None)
            when = self._events[0][0]
            self.now = when
            self._added, woken = False, False
            self._went_idle.clear()
            while self._events and self._events[0][0] == when:
                _, _, kind, payload = heapq.heappop(self._events)
                woken |= kind == "wake"
                await getattr(self, f"_on_{kind}")(payload)
            if woken or self._added or rules.acts_on_demand(self._wanted, self.queue.demand()) or self._grants_need_check():
                await self._tick()
            else:
                # Jobs ended, grants given back at logout, requests left with their sessions,
                # requests served at once by GPUs their jobs now run on: no rule acts the moment
                # something ends or a busy grant comes (every limit is at least a second), and the
                # only new times at which one may act are the idle clocks of the GPUs jobs left.
                self._wake_at(self.watch.next_moment_of(self._went_idle, self.now) if self._went_idle else None)
            self._wanted = self.queue.demand()  # as the batch left it (and the tick's releases served)
            self._count_granted()
            if self.fractions:
                self._measure()
        self._finish()
        return self.result

    def _at(self, when: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, payload))

    def _open_at(self, session: Session) -> None:
        if self._first is None:
            self._first = session.start
        self._at(session.start, "login", session)

    # --- events

    async def _on_login(self, session: Session) -> None:
        uid = self._uid(session.user)
        pid = next(self._pids)
        # As the PAM module's login; grant "never": a replayed login takes no GPU, its jobs ask for theirs.
        self.logins.open(self.account(session.user), "replay", "", "", pid, "never")
        self.sessions[pid] = _Session(uid, session.user, len(session.jobs), session.end is None)
        for job in session.jobs:
            self.result.demanded += job.gpus * job.duration
            self._user_totals(session.user)[1] += job.gpus * job.duration
            self._at(job.start, "arrive", (job, pid))
        if session.end is not None:
            self._at(session.end, "logout", pid)

    async def _on_arrive(self, payload: tuple[Job, int]) -> None:
        job, session = payload
        self._added |= self.now >= self._due  # a rule's moment has come, its tick not yet: checked now
        uid = self.sessions[session].uid
        # As `gpuguard request --wait` from the job's script, through the one path a request takes
        # (Asks.ask), but whole (a job cannot start on part of its GPUs) and with a place of its own
        # (each job of a batch waits for itself): counting the user's idle granted GPUs that no
        # waiting job of theirs counts on already.
        # A fraction counts on no GPU of its user's: it asks for one more (Ask.memory), or runs
        # on an idle fraction of theirs with room for it.
        fraction = self.fractions and fractional(job)
        mine = self._uncounted_idle(uid, job.memory if fraction else None)
        if fraction and mine:
            self._start(job, session, (mine[0],))
            return
        self._joining = (job, session)
        try:
            ask = Ask(self.account(self.names[uid]), None if fraction else job.gpus, Origin.SESSION, Waits.YES,
                      "a replayed job", keeps=() if fraction else tuple(mine), whole=True, one_place=False,
                      pid=session, memory=job.memory if fraction else None)
            answer = self.asks.ask(ask, self.now)
        finally:
            self._joining = None
        if answer.outcome == Outcome.REFUSED:  # over the quota's count, or more than the pool has
            self.result.over_quota += 1
            self._never_ran(job, session)
        elif answer.outcome == Outcome.WAITING:
            assert answer.place is not None
            self.pending.setdefault(uid, {})[answer.place.waiter.id] = (job, session)
        elif not answer.granted:  # its user's idle GPUs are enough: it runs on them (a grant served it: _served)
            self._start(job, session, tuple(mine[:job.gpus]))

    async def _on_end(self, payload: tuple[int, int]) -> None:
        pid, version = payload
        running = self.running.get(pid)
        if running is None or running.version != version:
            return  # ended earlier by a rule, or slowed or sped up since: a later end event stands
        self._stop(running)
        self._batch_gives_back(running)
        self.result.count(running.user, running.started - running.arrived, running.job.duration,
                          self.now - running.started, not fractional(running.job))
        self.result.stretch.append((self.now - running.started) / running.job.duration)
        self._job_done(running.session)

    async def _on_logout(self, pid: int) -> None:
        session = self.sessions[pid]
        session.closed = True
        self.logins.close(self.account(session.user), pid)
        await self.services.logout.settled()  # the release check after a last logout, in the background
        mine = self.pending.get(session.uid, {})
        if mine and not self.store.logged_in(session.uid):
            # The user's places end with their last session, also those of sessions closed before.
            waiting = {q.waiter.id for q in self.store.queue(session.uid)}
            for queue_id, (job, owner) in list(mine.items()):
                if queue_id not in waiting:
                    del mine[queue_id]
                    self._never_ran(job, owner)
        self._forget_if_done(pid)

    def _grants_need_check(self) -> bool:
        """Whether a rule may act at once on the grants that came and went in this batch of events,
        or has a new moment to act on them besides the idle clocks of the GPUs jobs left: one that
        went had a running job on its GPU (its process is now a stray), or one that came has no job
        on it (its idle clock runs) or a time limit (whose warnings are moments). A busy grant that
        came has no idle clock; a rule that acts on its new process is _start's to see
        (rules.acts_on_arrival)."""
        changes = self._seen.since()
        if not changes:
            return False
        nothing: Counter[int] = Counter()
        return (any(rules.acts_on_grant_change(g, self.busy_of.get(g.uid, nothing)[g.unit] > 0, came=False)
                    for g in changes.gone)
                or any(rules.acts_on_grant_change(g, self.busy_of.get(g.uid, nothing)[g.unit] > 0, came=True)
                       for g in changes.came))

    async def _on_wake(self, _: object) -> None:
        self._next_wake = None  # the tick after this batch of events runs the rules

    # --- the queue and the jobs

    def _served(self, queued: Queued, units: tuple[int, ...]) -> None:
        """The queue granted a waiter its GPUs: its job starts now."""
        mine = self.pending.get(queued.waiter.uid, {})
        waiting = mine.pop(queued.waiter.id, None) or self._joining  # None: served as it joined
        assert waiting is not None, "the queue served a request the replay did not make"
        self._start(*waiting, (*queued.counted, *units))  # a unit counted on and taken back was asked again

    def _start(self, job: Job, session: int, units: tuple[int, ...]) -> None:
        assert len(units) == job.gpus, (job, units)
        owner = self.sessions[session]
        pid = next(self._pids)
        identity = ProcessIdentity(pid, owner.uid, start_time=pid)  # unique, as a real start time is with its pid
        running = _Running(job, owner.user, owner.uid, session, units, pid, job.start, self.now, job.duration,
                           since=self.now, processes=tuple(GpuProcess(pid, m, job.memory or None) for m in units),
                           identity=identity, fraction=self.fractions and fractional(job))
        self.running[pid] = running
        # A check now only if a rule may act on the process at once, or may act already (its
        # time came, its tick has not).
        quota = self._quota(owner.user)
        self._added |= self.now >= self._due or any(rules.acts_on_arrival(g, quota, self.now)
                                                    for g in self.store.grants(owner.uid) if g.unit in units)
        self.busy_of.setdefault(owner.uid, Counter()).update(units)
        self._sample = None
        self.watch.started((pid, identity.start_time), self.now)
        self._crowd(units, add=pid)
        self.result.most_sharers = max(self.result.most_sharers, *(len(self.on_gpu[m]) for m in units))

    def _stop(self, running: _Running) -> None:
        """The job leaves its GPUs (ended, or stopped by a rule)."""
        del self.running[running.pid]
        mine = self.busy_of[running.uid]
        mine.subtract(running.units)
        for unit in running.units:
            if mine[unit] <= 0:
                del mine[unit]
        self._crowd(running.units, remove=running.pid)
        self._went_idle.update((running.uid, unit) for unit in running.units)
        self._sample = None
        self.watch.ended((running.pid, running.identity.start_time), [(running.uid, unit) for unit in running.units],
                         self.now)

    def _batch_gives_back(self, running: _Running) -> None:
        """A batch job (an open session) gives its GPUs back as it ends, as its script's last
        `gpuguard release` does, and as Slurm frees a job's GPUs: the queue has them at once, not
        after reclaim_after or an idle timeout (its user may run other jobs meanwhile, so their
        logout does not free them). An interactive session's GPUs stay with its user between its
        jobs, until a rule or the user's last logout takes them."""
        if not self.sessions[running.session].open:
            return
        still = self.busy_of.get(running.uid, Counter())
        if idle := [unit for unit in running.units if not still[unit]]:
            self.services.releases.take_back(running.uid, idle, self.now, kind=EventKind.RELEASE, rule=Rule.USER,
                                             message="released with gpuguard release")

    def _crowd(self, units: tuple[int, ...], add: int | None = None, remove: int | None = None) -> None:
        """A job joins or leaves these GPUs: count their busy and shared seconds up to now, then
        set every job there to the pace of its most crowded GPU (contention: n jobs on a GPU
        progress at 1/n each) and move its end accordingly."""
        for unit in units:
            jobs = self.on_gpu.setdefault(unit, set())
            if jobs:
                since = self.busy_since[unit]
                self.result.busy += self.now - since
                if len(jobs) > 1:
                    self.result.shared += self.now - since
            self.busy_since[unit] = self.now
            if add is not None:
                jobs.add(add)
            if remove is not None:
                jobs.discard(remove)
        for pid in set().union(*(self.on_gpu[m] for m in units)):
            running = self.running[pid]
            rate = 1.0 if running.fraction else 1.0 / max(len(self.on_gpu[m]) for m in running.units)
            if pid != add and rate == running.rate:
                continue
            running.left -= running.rate * (self.now - running.since)
            running.rate, running.since, running.version = rate, self.now, running.version + 1
            self._at(self.now + running.left / rate, "end", (pid, running.version))

    def _job_done(self, session: int) -> None:
        """One of the session's jobs ran or will never run; an open session ends with its last."""
        owner = self.sessions[session]
        owner.jobs_left -= 1
        if owner.open and owner.jobs_left == 0 and not owner.closed:
            self._at(self.now, "logout", session)
        self._forget_if_done(session)

    def _forget_if_done(self, session: int) -> None:
        """A session logged out with no job left to run or wait is forgotten (memory stays flat)."""
        owner = self.sessions.get(session)
        if owner is not None and owner.closed and owner.jobs_left <= 0:
            del self.sessions[session]

    def _never_ran(self, job: Job, session: int) -> None:
        self.result.never_ran += 1
        self.result.count(self.sessions[session].user, self.now - job.start, job.duration, None,
                          not fractional(job))
        self._job_done(session)

    def _uncounted_idle(self, uid: int, fraction: int | None = None) -> list[int]:
        """The user's granted GPUs with no job on them that no waiting job of theirs counts on, in
        order: whole ones, or (fraction: bytes) fractions that promise at least that much."""
        busy = self.busy_of.get(uid, ())
        idle = {g.unit for g in self.store.grants(uid) if g.unit not in busy
                and (g.fraction is None if fraction is None else (g.fraction or 0) >= fraction)}
        if idle and self.pending.get(uid):
            idle.difference_update(*(q.counted for q in self.store.queue(uid)))
        return sorted(idle)

    # --- the watcher

    def sample(self) -> Sample:
        """The running jobs as a GPU sample: each job's process on each of its GPUs. The same object
        until a job starts or ends (its time is then when they last changed): the watcher keeps
        what it made of the processes of the sample it saw before."""
        if self._sample is None:
            jobs = [running for running in self.running.values() if running.processes]
            self._sample = Sample(self.now, tuple(p for running in jobs for p in running.processes),
                                  {running.pid: running.identity for running in jobs},
                                  frozenset(self.grants.gpus))
        return self._sample

    async def _tick(self) -> None:
        sample = self.sample()
        for action in await self.watch.check(sample, self.now):
            if action.kind == rules.RELEASE and action.rule == rules.RECLAIM:
                self.result.reclaims += 1
            elif action.kind == rules.REVOKE:
                self.result.revokes += 1
        self._due = math.inf  # next_change over everything: what was due has been decided
        self._wake_at(self.watch.next_moment(self.sample(), self.now))

    def _wake_at(self, wake: float | None) -> None:
        """Check at `wake` (unless a check comes earlier anyway)."""
        if wake is not None:
            self._due = min(self._due, wake)
            interval = self.config.watcher.interval
            wake = math.ceil(wake / interval) * interval  # the daemon's tick comes at its own pace
            if self._next_wake is None or wake < self._next_wake:
                self._next_wake = wake
                self._at(wake, "wake")

    def stopped(self, pid: int) -> None:
        """A rule's signal reached the job: it ends here, and what it did is lost."""
        running = self.running[pid]
        self._stop(running)
        self._batch_gives_back(running)
        ran = self.now - running.started
        self.result.work_lost += len(running.units) * ran
        self.result.count(running.user, running.started - running.arrived, running.job.duration,
                          ran + running.job.duration, not fractional(running.job))  # it needs its whole duration again
        self.result.kills += 1
        self._job_done(running.session)

    # --- bookkeeping

    def _measure(self) -> None:
        """Count the time since the last batch of events as the queue and grants stood then (a
        fraction waiting: its seconds, and the GPUs unallocatable and stranded for it), and measure
        them as this batch left them: over the fractions waiting now, the smallest; over the GPUs
        that hold only fractions, those whose memory not promised is less than it."""
        since, waiting, stranded, stranding = self._measured
        if waiting and self.result.fraction_waiting is not None:
            elapsed = self.now - since
            self.result.fraction_waiting += elapsed
            self.result.unallocatable += stranded * elapsed
            self.result.stranding += stranding * elapsed
        smallest = min((q.quota.fraction for q in self.store.queue() if q.quota.fraction is not None), default=None)
        stranded, stranding = 0.0, 0
        if smallest is not None:
            promised: dict[int, int | None] = {}
            for grant in self.store.grants_read():
                taken = promised.get(grant.unit, 0)
                promised[grant.unit] = None if taken is None or grant.fraction is None else taken + grant.fraction
            for taken in promised.values():
                if taken is not None and GPU_MEMORY - taken < smallest:
                    stranded += (GPU_MEMORY - taken) / GPU_MEMORY
                    stranding += 1
        self._measured = (self.now, smallest is not None, stranded, stranding)

    def _count_granted(self, end: bool = False) -> None:
        """Count the GPU-seconds of the grants that ended in the last batch of events (all, at the end)."""
        changes = self._seen.count(end)
        if not changes:
            return  # no grant came or went since the last count
        ended = {grant_key(g): g.user for g in changes.gone}
        for key in sorted(ended.keys() - set(map(grant_key, changes.came))):  # one of the same key stands: it goes on
            self._taken_back += not end
            self.result.granted += self.now - key[2]
            self._user_totals(ended[key])[0] += self.now - key[2]

    def _finish(self) -> None:
        self._count_granted(end=True)
        left = sorted(item for mine in self.pending.values() for item in mine.items())  # by queue row, as they came
        for _, (job, session) in left:  # still waiting at the end: censored there
            self._never_ran(job, session)
        self.result.releases = self._taken_back - self.result.reclaims - self.result.revokes
        self.result.span = self.now - (self._first or 0.0)
        self.services.close()

    def _quota(self, user: str) -> Quota:
        """The user's quota as the daemon resolves it (every replayed user is in access.group)."""
        if user not in self.quotas:
            self.quotas[user] = policy.quota_for(user, {self.config.access.group}, self.config)
        return self.quotas[user]

    def account(self, user: str) -> Account:
        return Account(user, self._uid(user), frozenset({self.config.access.group}))

    def _uid(self, user: str) -> int:
        if user not in self.uids:
            self.uids[user] = FIRST_UID + len(self.uids)
            self.names[self.uids[user]] = user
        return self.uids[user]

    def _user_totals(self, user: str) -> list[float]:
        return self.result.per_user.setdefault(user, [0.0, 0.0])


MAX_POOL = 100_000  # GPUs in a replayed pool; more is a typo


def static_reservation(sessions: Iterable[Session], gpus: int) -> Result:
    """Each session holds its largest job's GPUs from start to end, first come first served; a
    session that has to wait is shifted by its wait, and its jobs with it."""
    result = Result()
    free = gpus
    holding: list[tuple[float, int]] = []  # (end, GPUs) of the sessions holding GPUs
    last_grant = float("-inf")
    first: float | None = None
    last_end = 0.0
    for session in sessions:
        first = session.start if first is None else first
        need = max((job.gpus for job in session.jobs), default=0)
        demanded = sum(job.gpus * job.duration for job in session.jobs)
        result.demanded += demanded
        totals = result.per_user.setdefault(session.user, [0.0, 0.0])
        totals[1] += demanded
        if need == 0:
            continue
        if need > gpus:  # more than the pool has
            result.never_ran += len(session.jobs)
            result.over_quota += len(session.jobs)
            for job in session.jobs:
                result.count(session.user, 0.0, job.duration, None, not fractional(job))
            continue
        at = max(session.start, last_grant)  # nobody overtakes an earlier session
        while holding and holding[0][0] <= at:
            free += heapq.heappop(holding)[1]
        while free < need:
            end, count = heapq.heappop(holding)
            free += count
            at = max(at, end)
        delay = at - session.start
        free -= need
        end = session.last
        heapq.heappush(holding, (end + delay, need))
        last_grant = at
        last_end = max(last_end, end + delay)
        result.granted += need * (end - session.start)
        totals[0] += need * (end - session.start)
        result.busy += demanded  # each job alone on its GPUs, at full speed
        for job in session.jobs:
            result.count(session.user, delay, job.duration, job.duration, not fractional(job))
            result.stretch.append(1.0)
        result.releases += 1
        result.most_sharers = 1
    result.span = last_end - (first or 0.0)
    return result


def replay(sessions: Iterable[Session], config: Config, gpus: int, fractions: bool = False) -> Result:
    """The configured policy on `gpuguard replay`'s pool of `gpus` GPUs (fractions: the jobs a
    fraction could serve ask for one, placed as config.scheduler.fraction_placement says). The
    services' event log (a line per grant, release and warning, as the daemon logs them) is
    silenced meanwhile: a replay reports counts."""
    quiet, logs.logger.disabled = logs.logger.disabled, True
    try:
        with tempfile.TemporaryDirectory(prefix="gpuguard-replay-") as scratch:
            return asyncio.run(Replay(config, gpus, Path(scratch), fractions).run(sessions))
    finally:
        logs.logger.disabled = quiet


def describe(sessions: Iterable[Session]) -> dict[str, float | int]:
    count = jobs = 0
    first, last = float("inf"), float("-inf")
    for session in sessions:
        count += 1
        jobs += len(session.jobs)
        first, last = min(first, session.start), max(last, session.last)
    return {"sessions": count, "jobs": jobs, "hours": (last - first) / 3600 if count else 0.0}


def with_placement(config: Config, placement: Placement) -> Config:
    """The config with fractions placed by `placement` ([scheduler] fraction_placement)."""
    return replace(config, scheduler=replace(config.scheduler, fraction_placement=placement))


def compare(open_trace: Callable[[], Iterable[Session]], config: Config, gpus: int,
            fractions: bool = False) -> dict[str, Any]:
    """The configured policy and static reservation on the same pool, in one run (the trace is
    read once per pass, never held whole). fractions: also the configured policy with fractions
    on, placed by each placement in turn (keyed by Placement's value: "fgd", "best-fit",
    "first-fit"); "policy" is then fractions off, every job on whole GPUs."""
    started = time.perf_counter()
    ours = replay(open_trace(), config, gpus)
    elapsed = time.perf_counter() - started
    static = static_reservation(open_trace(), gpus)
    report = {"gpus": gpus, "trace": describe(open_trace()), "seconds": elapsed,
              "policy": ours.summary(gpus), "static": static.summary(gpus)}
    if fractions:
        for placement in Placement:
            report[placement.value] = replay(open_trace(), with_placement(config, placement), gpus, True).summary(gpus)
        report["seconds"] = time.perf_counter() - started
    return report
